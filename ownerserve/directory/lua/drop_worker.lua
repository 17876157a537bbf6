-- drop_worker: owner death. Its leases end, replicas and cached view go, its sessions lose
-- their owner, its event seq resets. KEYS: rep, w:<worker>. ARGV: P, worker
local worker = ARGV[2]
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
for _, b in ipairs(redis.call('SMEMBERS', wp .. ':reps')) do
  local r = redis.call('HGET', KEYS[1], b)
  if r then
    local keep = {}
    for line in string.gmatch(r, '[^\n]*\n') do
      if string.match(line, '^(.*)\t%a+\t%d+\t[01]\n$') == worker then
        dropped = dropped + 1
      else
        keep[#keep + 1] = line
      end
    end
    if #keep > 0 then
      redis.call('HSET', KEYS[1], b, table.concat(keep))
    else
      redis.call('HDEL', KEYS[1], b)
    end
  end
end
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
