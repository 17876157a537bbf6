-- release: give up ownership; the blocks become claimable. KEYS: art. ARGV: P, id, worker, epoch
local rec = redis.call('HGET', KEYS[1], ARGV[2])
if not rec then
  return { 'ok', 0 }
end
local w, e = parse_lease(rec)
if w ~= ARGV[3] or e ~= tonumber(ARGV[4]) then
  return { 'stale', e }
end
delete_artifact(ARGV[2], w)
return { 'ok', 1 }
