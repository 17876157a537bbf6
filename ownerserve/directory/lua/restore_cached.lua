-- restore a worker's cached view (engine hash, block, tier bits) after the server lost it.
-- KEYS: w:<worker>, w:<worker>:eh, cache. ARGV: P, worker, then triples engine, block hex, bits
local j = redis.call('HGET', KEYS[1], 'idx')
if not j then
  return -1
end
j = tonumber(j)
local n = 0
for i = 3, #ARGV, 3 do
  local b = ARGV[i + 1]
  local v = redis.call('HGET', KEYS[3], b)
  local c = v and (string.byte(v, j) or 0) or 0
  local nv = bit.bor(c, tonumber(ARGV[i + 2]))
  if nv ~= c then
    write_byte(KEYS[3], b, v, j, nv)
  end
  redis.call('HSET', KEYS[2], ARGV[i], b)
  n = n + 1
end
return n
