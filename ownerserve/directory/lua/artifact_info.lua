-- artifact_info: lease and metadata of one artifact. KEYS: art, a:<id>, f:<id>, use. ARGV: P, id
local rec = redis.call('HGET', KEYS[1], ARGV[2])
if not rec then
  return false
end
local w, e, x, t = parse_lease(rec)
local m = redis.call('HMGET', KEYS[2], 'start', 'n', 'size', 'kv', 'created')
local reuse, last = 0, m[5]
local use = redis.call('HGET', KEYS[4], ARGV[2])
if use then
  local r, l = string.match(use, '^(%d+)\t(%d+)$')
  reuse, last = tonumber(r), l
end
local live = 0
if x > now_ms() then
  live = 1
end
return { w, e, x, t, live, m[1], m[2], m[3], m[4], m[5], last, reuse, redis.call('SCARD', KEYS[3]) }
