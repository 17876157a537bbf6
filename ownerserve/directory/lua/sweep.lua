-- sweep: one HSCAN step over leases and block records, deleting what expired and writing the
-- leases' expiry hints (`sweep_due` then only visits what is due; replica lines written before
-- the hints existed are left to the next full scan). KEYS: art, blk
-- ARGV: P, lease cursor ('-' = done), block cursor ('-' = done), count
local now = now_ms()
local dropped = 0
local c1, c2 = '-', '-'
if ARGV[2] ~= '-' then
  local res = redis.call('HSCAN', KEYS[1], ARGV[2], 'COUNT', ARGV[4])
  c1 = res[1]
  local kv = res[2]
  for k = 1, #kv, 2 do
    local w, _, x = parse_lease(kv[k + 1])
    if x <= now then
      delete_artifact(kv[k], w)
      dropped = dropped + 1
    else
      hint_lease(kv[k], x)
    end
  end
end
if ARGV[3] ~= '-' then
  local res = redis.call('HSCAN', KEYS[2], ARGV[3], 'COUNT', ARGV[4])
  c2 = res[1]
  local kv = res[2]
  local blocks = {}
  for k = 1, #kv, 2 do
    if string.find(kv[k + 1], '\n.', 17) then -- has replica lines
      blocks[#blocks + 1] = kv[k]
    end
  end
  dropped = dropped + prune_reps(blocks, now)
end
return { c1, c2, dropped }
