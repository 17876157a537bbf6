-- restore a worker's cached view (engine hash, block, tier bits) after the server lost it.
-- KEYS: w:<worker>, w:<worker>:eh, blk. ARGV: P, worker, then triples engine, block hex, bits
local j = redis.call('HGET', KEYS[1], 'idx')
if not j then
  return -1
end
j = tonumber(j)
local bits, blocks, pairs_ = {}, {}, {}
for i = 3, #ARGV, 3 do
  local b = ARGV[i + 1]
  if bits[b] == nil then
    blocks[#blocks + 1] = b
    bits[b] = 0
  end
  bits[b] = bit.bor(bits[b], tonumber(ARGV[i + 2]))
  pairs_[#pairs_ + 1] = ARGV[i]
  pairs_[#pairs_ + 1] = b
end
update_blocks(blocks, function(k, own, cache, reps)
  local c = string.byte(cache, j) or 0
  local nv = bit.bor(c, bits[blocks[k]])
  if nv ~= c then
    return own, cache_set(cache, j, nv), reps
  end
end)
multi('HSET', KEYS[2], pairs_)
return #blocks
