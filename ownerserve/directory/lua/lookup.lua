-- lookup: every worker's longest held prefix of a chain per tier and kind, the owner of the
-- deepest owned block, and the session owner. KEYS: blk, art, reuse [, s:<sid>]
-- ARGV: P, chain (16 hex digits per block), touch: '1' count a reuse of each live artifact met
-- here, 'r' return their ids instead (the client batches the counting: `touch.lua`), '0' neither
-- Reply: session owner, holdings as lines "worker \t tier \t blocks \t o|r" and
-- "worker index \t tier \t blocks \t c" (the client knows the names), owner, its blocks, its
-- epoch, its artifact id, the ids of the live artifacts met when touch is 'r'.
local blocks = split16(ARGV[2])
local n = #blocks
local sess = false
if KEYS[4] then
  sess = redis.call('GET', KEYS[4])
end
if n == 0 then
  return { sess, '', false, 0, 0, false, '' }
end
local vals = hmget(KEYS[1], blocks)
local now = now_ms()
local out = {}
local strs = {} -- number -> string: Lua's own conversion (sprintf) is slow
local function str(x)
  local s = strs[x]
  if not s then
    s = tostring(x)
    strs[x] = s
  end
  return s
end
local deep, ids = {}, {} -- artifact id -> deepest index in the chain
local rdeep, rkeys = {}, {} -- "worker \t tier" of a live replica -> deepest index
local alive = {} -- cached: worker index -> tier bits still contiguous from block 1
local lost_j, lost_m, lost_n = {}, {}, {} -- (worker index, tier bits, blocks) that ended
local open = true
local last_cache = false

-- walk runs of identical records: inside a run only the run's end matters
local s = 1
while s <= n do
  local v = vals[s]
  local e = s
  while e < n and vals[e + 1] == v do
    e = e + 1
  end
  if v then
    local own, cache, reps = rec_parse(v)
    if own then
      if deep[own] == nil then
        ids[#ids + 1] = own
      end
      deep[own] = e
    end
    if reps ~= '' then
      for w, t, x in string.gmatch(reps, '([^\t\n]*)\t(%a+)\t(%d+)\t[01]\n') do
        if tonumber(x) > now then
          local key = w .. '\t' .. t
          if rdeep[key] == nil then
            rkeys[#rkeys + 1] = key
          end
          rdeep[key] = e
        end
      end
    end
    if open and cache ~= last_cache then -- alive bits are within every cache string seen
      last_cache = cache
      if s == 1 then
        for j = 1, #cache do
          local b = string.byte(cache, j)
          if b ~= 0 then
            alive[j] = b
          end
        end
      else
        for j, m in pairs(alive) do
          local kept = bit.band(m, string.byte(cache, j) or 0)
          if kept ~= m then
            local k = #lost_j + 1
            lost_j[k], lost_m[k], lost_n[k] = j, bit.band(m, bit.bnot(kept)), s - 1
            if kept == 0 then
              alive[j] = nil
            else
              alive[j] = kept
            end
          end
        end
      end
      open = next(alive) ~= nil
    end
  elseif open then
    for j, m in pairs(alive) do
      local k = #lost_j + 1
      lost_j[k], lost_m[k], lost_n[k] = j, m, s - 1
    end
    alive = {}
    open = false
  end
  s = e + 1
end
for j, m in pairs(alive) do
  local k = #lost_j + 1
  lost_j[k], lost_m[k], lost_n[k] = j, m, n
end

-- owners: the live leases of the artifacts met
local owner, owner_blocks, owner_epoch, owner_id = false, 0, 0, false
local live = {}
if #ids > 0 then
  local recs = hmget(KEYS[2], ids)
  local best, order = {}, {}
  for k = 1, #ids do
    local rec = recs[k]
    if rec then
      local w, e, x, t = parse_lease(rec)
      if x > now then
        local d = deep[ids[k]]
        local key = w .. '\t' .. t
        if best[key] == nil then
          order[#order + 1] = key
          best[key] = d
        elseif best[key] < d then
          best[key] = d
        end
        if d > owner_blocks then
          owner, owner_blocks, owner_epoch, owner_id = w, d, e, ids[k]
        end
        live[#live + 1] = ids[k]
      end
    end
  end
  for _, key in ipairs(order) do
    out[#out + 1] = key .. '\t' .. str(best[key]) .. '\to\n'
  end
  if ARGV[3] == '1' and #live > 0 then
    -- reuse counts and last access: one HINCRBY per artifact met, one HSET for all
    local stamp = fmt(now)
    local sets = {}
    for k = 1, #live do
      redis.call('HINCRBY', KEYS[3], live[k], 1)
      sets[#sets + 1] = live[k]
      sets[#sets + 1] = stamp
    end
    multi('HSET', P .. 'last', sets)
  end
end

for _, key in ipairs(rkeys) do
  out[#out + 1] = key .. '\t' .. str(rdeep[key]) .. '\tr\n'
end

for k = 1, #lost_j do
  local m = lost_m[k]
  local tail = '\t' .. str(lost_n[k]) .. '\tc\n'
  if m == 1 then
    out[#out + 1] = str(lost_j[k]) .. '\tgpu' .. tail
  else
    for _, tb in ipairs(TIER_BITS) do
      if bit.band(m, tb[2]) ~= 0 then
        out[#out + 1] = str(lost_j[k]) .. '\t' .. tb[1] .. tail
      end
    end
  end
end
local touched = ''
if ARGV[3] == 'r' then
  touched = table.concat(live)
end
return { sess, table.concat(out), owner, owner_blocks, owner_epoch, owner_id, touched }
