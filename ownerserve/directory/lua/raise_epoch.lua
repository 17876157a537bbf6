-- raise the fencing epoch counter to at least ARGV[2] (after a data loss: epochs never repeat)
-- KEYS: epoch. ARGV: P, floor
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[2])
if cur < floor then
  redis.call('SET', KEYS[1], string.format('%d', floor))
  return floor
end
return cur
