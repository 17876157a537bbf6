-- artifact_info: lease and metadata of one artifact. KEYS: art, a:<id>, f:<id>, reuse. ARGV: P, id
local rec = redis.call('HGET', KEYS[1], ARGV[2])
if not rec then
  return false
end
local w, e, x, t = parse_lease(rec)
local m = redis.call('HMGET', KEYS[2], 'start', 'n', 'size', 'kv', 'created')
local reuse = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
local last = redis.call('HGET', P .. 'last', ARGV[2]) or m[5]
local live = 0
if x > now_ms() then
  live = 1
end
return { w, e, x, t, live, m[1], m[2], m[3], m[4], m[5], last, reuse, redis.call('SCARD', KEYS[3]) }
