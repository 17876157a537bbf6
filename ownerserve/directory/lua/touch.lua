-- touch: count the reuses clients batched from their lookups ('r' mode) and stamp last access.
-- KEYS: reuse, last, art. ARGV: P, then pairs of artifact id and count
local stamp = fmt(now_ms())
local sets = {}
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then -- not released meanwhile
    redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
    sets[#sets + 1] = ARGV[i]
    sets[#sets + 1] = stamp
    n = n + 1
  end
end
multi('HSET', KEYS[2], sets)
return n
