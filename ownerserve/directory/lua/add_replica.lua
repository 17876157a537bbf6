-- add_replica: one step of a read-only copy on a worker/tier that expires. KEYS: blk
-- ARGV: P, worker, tier, ttl_ms, read_only (0/1), blocks hex (this step's), expires_ms ('' =
-- now + ttl_ms: the first step's; later steps pass what it returned, so every line of the
-- copy is the same). A step writes its blocks' replica lines, lists them in the worker's
-- `:reps` set and hints their expiry; the client steps through the chain in order, so
-- between steps a reader sees the copy on a leading part of it. Returns expires_ms.
local now = now_ms()
local blocks = split16(ARGV[6])
local worker, tier = ARGV[2], ARGV[3]
local exp = ARGV[7] == '' and now + tonumber(ARGV[4]) or tonumber(ARGV[7])
local entry = worker .. '\t' .. tier .. '\t' .. fmt(exp) .. '\t' .. ARGV[5] .. '\n'
update_blocks(blocks, function(i, own, cache, reps)
  return own, cache, put_replica(blocks[i], reps, worker, tier, entry, now)
end)
multi('SADD', P .. 'w:' .. worker .. ':reps', blocks)
hint_reps(blocks, exp)
return fmt(exp)
