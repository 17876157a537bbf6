-- holder: start or extend a replica holder's liveness lease (`renew_replica_holder`): one
-- record in `hold`, so a holder of any number of lines renews in O(1). KEYS: hold, hx.
-- ARGV: P, worker, tier, incarnation (decimal), ttl_ms.
-- Returns 1: the live lease of this incarnation extended; 0: a lease started (none, or
-- another incarnation's: its lines count no more, and the next sweep purges them); -1: this
-- incarnation's lease had lapsed or was ended by `drop_worker` (not revived: a sweep may have
-- purged part of its lines).
local now = now_ms()
local f = ARGV[2] .. '\t' .. ARGV[3]
local inc = ARGV[4]
local cur = redis.call('HGET', KEYS[1], f)
local old, x = false, 0
if cur then
  old, x = string.match(cur, '^(%d+)\t(%d+)$')
  x = tonumber(x)
end
if old == inc and x <= now then
  return -1
end
local exp = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], f, inc .. '\t' .. fmt(exp))
if old and old ~= inc then
  -- a purge of the predecessor's lines: due at the next sweep, which scans the worker's
  -- `:reps` set from this cursor on (what is live there stays)
  redis.call('HSET', HXC, f, '0')
  redis.call('ZADD', KEYS[2], now, f)
elseif redis.call('HEXISTS', HXC, f) == 0 then
  redis.call('ZADD', KEYS[2], exp, f) -- a purge due stays due
end
if old == inc then
  return 1
end
return 0
