-- drop_replicas: one step of withdrawing `worker`'s replica lines in `tier` (held or with a
-- TTL) from `blocks`; a block where the worker keeps no line leaves its `:reps` set.
-- KEYS: blk. ARGV: P, worker, tier, blocks hex (this step's). Returns the lines dropped.
local worker, tier = ARGV[2], ARGV[3]
local blocks = split16(ARGV[4])
local dropped = 0
local unlisted = {}
update_blocks(blocks, function(i, own, cache, reps)
  local keep, other, gone = {}, false, false
  for line in string.gmatch(reps, '[^\n]*\n') do
    local w, t = string.match(line, '^([^\t]*)\t(%a+)\t')
    if w == worker and t == tier then
      gone = true
    else
      keep[#keep + 1] = line
      other = other or w == worker
    end
  end
  if gone then
    dropped = dropped + 1
    if not other then
      unlisted[#unlisted + 1] = blocks[i]
    end
    return own, cache, table.concat(keep)
  end
end)
multi('SREM', P .. 'w:' .. worker .. ':reps', unlisted)
return dropped
