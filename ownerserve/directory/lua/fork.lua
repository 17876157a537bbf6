-- fork refs: the sessions sharing an artifact copy-on-write. KEYS: f:<id>. ARGV: P, 'add'|'drop', sid
-- `P forks` lists the ids that have refs, for `sweep` (which drops refs of ended sessions)
local id = string.sub(KEYS[1], #P + 3)
if ARGV[2] == 'add' then
  redis.call('SADD', KEYS[1], ARGV[3])
  redis.call('SADD', P .. 'forks', id)
  redis.call('ZADD', FX, session_end(ARGV[3], now_ms()), id .. '\t' .. ARGV[3])
else
  redis.call('SREM', KEYS[1], ARGV[3])
  redis.call('ZREM', FX, id .. '\t' .. ARGV[3])
end
local n = redis.call('SCARD', KEYS[1])
if n == 0 then
  redis.call('SREM', P .. 'forks', id)
end
return n
