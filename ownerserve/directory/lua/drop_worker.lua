-- drop_worker: owner death. Its leases end, replicas and cached view go, its sessions lose
-- their owner, its event seq resets, its life count goes up. KEYS: blk, w:<worker>.
-- ARGV: P, worker, life ('' = any): the count the caller saw while the worker lived; past it
-- (that life was dropped already, the worker may be back and recording) nothing goes: -1.
local worker = ARGV[2]
local life = tonumber(redis.call('HGET', KEYS[2], 'life') or '0')
if ARGV[3] ~= '' and life > tonumber(ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[2], 'life', life + 1)
local wp = P .. 'w:' .. worker
local dropped = 0
for _, id in ipairs(redis.call('SMEMBERS', wp .. ':arts')) do
  local rec = redis.call('HGET', P .. 'art', id)
  if rec and parse_lease(rec) == worker then
    delete_artifact(id, worker)
    dropped = dropped + 1
  end
end
redis.call('DEL', wp .. ':arts')
update_blocks(redis.call('SMEMBERS', wp .. ':reps'), function(_, own, cache, reps)
  local keep, gone = reps_without(reps, worker, nil)
  if gone > 0 then
    dropped = dropped + gone
    return own, cache, keep
  end
end)
redis.call('DEL', wp .. ':reps')
local j = redis.call('HGET', KEYS[2], 'idx')
if j then
  dropped = dropped + clear_cached(worker, tonumber(j))
end
for _, sid in ipairs(redis.call('SMEMBERS', wp .. ':sess')) do
  local k = P .. 's:' .. sid
  if redis.call('GET', k) == worker then
    redis.call('DEL', k)
    dropped = dropped + 1
  end
end
redis.call('DEL', wp .. ':sess')
redis.call('HDEL', KEYS[2], 'seq')
return dropped
