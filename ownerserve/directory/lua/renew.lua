-- renew: extend a live lease held by worker at epoch. KEYS: art. ARGV: P, id, worker, epoch, lease_ms
local rec = redis.call('HGET', KEYS[1], ARGV[2])
if not rec then
  return { 'stale', 0, 'no lease' }
end
local w, e, x, t = parse_lease(rec)
if w ~= ARGV[3] or e ~= tonumber(ARGV[4]) then
  return { 'stale', e, 'epoch' }
end
local now = now_ms()
if x <= now then
  return { 'stale', e, 'expired' }
end
local nx = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], ARGV[2], pack_lease(w, e, nx, t))
hint_lease(ARGV[2], nx)
return { 'ok', nx }
