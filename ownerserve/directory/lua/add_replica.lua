-- add_replica: a read-only copy on a worker/tier that expires. KEYS: blk
-- ARGV: P, id, worker, tier, ttl_ms, read_only (0/1), blocks hex ('' = the artifact's own blocks)
local now = now_ms()
local blocks
if ARGV[7] == '' then
  local bh = redis.call('HGET', P .. 'a:' .. ARGV[2], 'blocks')
  if bh then
    blocks = split16(bh)
  else
    blocks = { ARGV[2] }
  end
else
  blocks = split16(ARGV[7])
end
local worker, tier = ARGV[3], ARGV[4]
local exp = now + tonumber(ARGV[5])
local entry = worker .. '\t' .. tier .. '\t' .. fmt(exp) .. '\t' .. ARGV[6] .. '\n'
update_blocks(blocks, function(i, own, cache, reps)
  return own, cache, put_replica(blocks[i], reps, worker, tier, entry, now)
end)
multi('SADD', P .. 'w:' .. worker .. ':reps', blocks)
hint_reps(blocks, exp)
return 1
