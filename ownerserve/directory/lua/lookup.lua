-- lookup: every worker's longest held prefix of a chain per tier and kind, the owner of the
-- deepest owned block, and the session owner. KEYS: own, art, rep, cache, widx [, s:<sid>]
-- ARGV: P, chain (16 hex digits per block), touch ('1': count a reuse of each live artifact)
local blocks = split16(ARGV[2])
local n = #blocks
local sess = false
if KEYS[6] then
  sess = redis.call('GET', KEYS[6])
end
if n == 0 then
  return { sess, {}, false, 0, 0, false }
end
local now = now_ms()
local out = {}

-- owners: deepest block of each artifact, walking from the end (runs of one artifact skipped)
local own = hmget(KEYS[1], blocks)
local ids, deep = {}, {}
local prev = false
for i = n, 1, -1 do
  local a = own[i]
  if a and a ~= prev and deep[a] == nil then
    deep[a] = i
    ids[#ids + 1] = a
  end
  prev = a
end
local owner, owner_blocks, owner_epoch, owner_id = false, 0, 0, false
if #ids > 0 then
  local recs = hmget(KEYS[2], ids)
  local best = {}
  for k = 1, #ids do
    local rec = recs[k]
    if rec then
      local w, e, x, t = parse_lease(rec)
      if x > now then
        local d = deep[ids[k]]
        local key = w .. '\t' .. t
        if (best[key] or 0) < d then
          best[key] = d
        end
        if d > owner_blocks then
          owner, owner_blocks, owner_epoch, owner_id = w, d, e, ids[k]
        end
        if ARGV[3] == '1' then
          local ak = P .. 'a:' .. ids[k]
          redis.call('HINCRBY', ak, 'reuse', 1)
          redis.call('HSET', ak, 'last', fmt(now))
        end
      end
    end
  end
  for key, d in pairs(best) do
    local w, t = string.match(key, '^(.*)\t(%a+)$')
    out[#out + 1] = w
    out[#out + 1] = t
    out[#out + 1] = d
    out[#out + 1] = 'owner'
  end
end

-- replicas: deepest live entry per (worker, tier)
local rep = hmget(KEYS[3], blocks)
local rseen = {}
prev = false
for i = n, 1, -1 do
  local r = rep[i]
  if r and r ~= prev then
    for w, t, x in string.gmatch(r, '([^\t\n]*)\t(%a+)\t(%d+)\t[01]\n') do
      local key = w .. '\t' .. t
      if not rseen[key] and tonumber(x) > now then
        rseen[key] = true
        out[#out + 1] = w
        out[#out + 1] = t
        out[#out + 1] = i
        out[#out + 1] = 'replica'
      end
    end
  end
  prev = r
end

-- cached: longest contiguous run from block 1 per (worker, tier); a run of identical values
-- (same holders) costs one string comparison per block
local cache = hmget(KEYS[4], blocks)
local first = cache[1]
if first then
  local alive, lost = {}, {}
  for j = 1, #first do
    local b = string.byte(first, j)
    if b ~= 0 then
      alive[j] = b
    end
  end
  local length = 1
  prev = first
  for i = 2, n do
    if next(alive) == nil then
      break
    end
    local v = cache[i]
    if v ~= prev then
      for j, m in pairs(alive) do
        local kept = 0
        if v then
          kept = bit.band(m, string.byte(v, j) or 0)
        end
        if kept ~= m then
          lost[#lost + 1] = { j, bit.band(m, bit.bnot(kept)), i - 1 }
          if kept == 0 then
            alive[j] = nil
          else
            alive[j] = kept
          end
        end
      end
      prev = v
    end
    length = i
  end
  for j, m in pairs(alive) do
    lost[#lost + 1] = { j, m, length }
  end
  if #lost > 0 then
    local idx = {}
    for k = 1, #lost do
      idx[k] = tostring(lost[k][1])
    end
    local names = hmget(KEYS[5], idx)
    for k = 1, #lost do
      local w = names[k]
      if w then
        for _, tb in ipairs(TIER_BITS) do
          if bit.band(lost[k][2], tb[2]) ~= 0 then
            out[#out + 1] = w
            out[#out + 1] = tb[1]
            out[#out + 1] = lost[k][3]
            out[#out + 1] = 'cached'
          end
        end
      end
    end
  end
end
return { sess, out, owner, owner_blocks, owner_epoch, owner_id }
