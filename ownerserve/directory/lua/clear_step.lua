-- clear_step: one step of dropping a worker's cached views set aside (`defer_clear` in
-- common.lua): the blocks left in them lose the worker's cached bits (but those it stored
-- again since, in `:clrfresh`), a page at a time, until ARGV[3] entries are spent (one page
-- at least, so every step makes progress); a pending clear emptied leaves the `:clears` set,
-- and with the last one the `:clrfresh` list goes. KEYS: w:<worker>. ARGV: P, worker,
-- entries. Returns { blocks cleared, 1 if pending clears are left else 0 }.
local wp = P .. 'w:' .. ARGV[2]
local pending, fk = wp .. ':clears', wp .. ':clrfresh'
local j = tonumber(redis.call('HGET', KEYS[1], 'idx') or '0')
local budget = tonumber(ARGV[3])
local PAGE = 64
local cleared, spent = 0, 0
while spent < budget do
  local n = redis.call('SRANDMEMBER', pending)
  if not n then
    break
  end
  local key = wp .. ':clr' .. n
  while spent < budget and redis.call('EXISTS', key) == 1 do
    local page = take_hash_page(key, math.min(PAGE, math.max(1, budget - spent)))
    local stale = {}
    for _, b in ipairs(page) do
      if redis.call('SISMEMBER', fk, b) == 0 then
        stale[#stale + 1] = b
      end
    end
    cleared = cleared + uncache(stale, j)
    spent = spent + math.max(1, #page)
  end
  if redis.call('EXISTS', key) == 0 then
    redis.call('DEL', key .. 'c') -- emptied by its pages before its HSCAN round ended
    redis.call('SREM', pending, n)
  end
end
local more = redis.call('SCARD', pending) > 0 and 1 or 0
if more == 0 then
  redis.call('DEL', fk)
end
return { cleared, more }
