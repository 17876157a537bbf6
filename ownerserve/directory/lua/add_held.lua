-- add_held: one step of `add_held_replicas`: read-only lines of `worker` in `tier` that live
-- as long as its replica holder does at `incarnation` (expiry field 'h' .. incarnation; no
-- sweep hint of their own: `hx` finds them once the holder is gone). KEYS: blk.
-- ARGV: P, worker, tier, incarnation, blocks hex (this step's).
-- Returns 1, or -1 (nothing written) unless the holder lives at that incarnation.
local now = now_ms()
local worker, tier = ARGV[2], ARGV[3]
if live_holders(now)[worker .. '\t' .. tier] ~= ARGV[4] then
  return -1
end
local blocks = split16(ARGV[5])
local entry = worker .. '\t' .. tier .. '\th' .. ARGV[4] .. '\t1\n'
update_blocks(blocks, function(i, own, cache, reps)
  return own, cache, put_replica(blocks[i], reps, worker, tier, entry, now)
end)
multi('SADD', P .. 'w:' .. worker .. ':reps', blocks)
return 1
