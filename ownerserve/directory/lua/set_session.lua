-- set_session_owner. KEYS: s:<sid>. ARGV: P, sid, worker, ttl_ms
local old = redis.call('GET', KEYS[1])
if old and old ~= ARGV[3] then
  redis.call('SREM', P .. 'w:' .. old .. ':sess', ARGV[2])
  redis.call('ZREM', SX, old .. '\t' .. ARGV[2])
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', P .. 'w:' .. ARGV[3] .. ':sess', ARGV[2])
redis.call('SADD', P .. 'wsess', ARGV[3]) -- workers whose `:sess` sets `sweep` prunes
redis.call('ZADD', SX, now_ms() + tonumber(ARGV[4]), ARGV[3] .. '\t' .. ARGV[2])
return 1
