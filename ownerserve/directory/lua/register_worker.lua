-- register_worker: give the worker a byte index in cached values and record its chain root and
-- block size (a change drops its cached view, in steps). KEYS: workers, widx, w:<worker>, wnext
-- ARGV: P, worker, root (hex), block size
local worker = ARGV[2]
local j = redis.call('HGET', KEYS[1], worker)
if not j then
  j = redis.call('INCR', KEYS[4])
  redis.call('HSET', KEYS[1], worker, j)
  redis.call('HSET', KEYS[2], j, worker)
else
  local cur = redis.call('HMGET', KEYS[3], 'root', 'bs')
  if cur[1] and (cur[1] ~= ARGV[3] or cur[2] ~= ARGV[4]) then
    defer_clear(worker) -- the caller runs `clear_step` after
    redis.call('HDEL', KEYS[3], 'seq')
  end
end
redis.call('HSET', KEYS[3], 'root', ARGV[3], 'bs', ARGV[4], 'idx', j)
return tonumber(j)
