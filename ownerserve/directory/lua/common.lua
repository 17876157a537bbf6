-- Prepended to every OwnerServe directory script. ARGV[1] is the key prefix "{ns}:"; every
-- key a script touches starts with it, so all of them hash to one Redis Cluster slot.
if redis.replicate_commands then redis.replicate_commands() end
local P = ARGV[1]
local TIER_BITS = { { 'gpu', 1 }, { 'cpu', 2 }, { 'ssd', 4 } }
local CHUNK = 4000 -- stays below Lua's unpack() limit

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x)
  return string.format('%d', x)
end

-- "16 hex digits per block" -> list of block field names
local function split16(hex)
  local out = {}
  for i = 1, #hex, 16 do
    out[#out + 1] = string.sub(hex, i, i + 15)
  end
  return out
end

local function split_csv(csv)
  local out = {}
  for s in string.gmatch(csv, '[^,]+') do
    out[#out + 1] = s
  end
  return out
end

-- lease record in the `art` hash: "worker \t epoch \t expires_ms \t tier"
local function parse_lease(rec)
  local w, e, x, t = string.match(rec, '^(.*)\t(%d+)\t(%d+)\t(%a+)$')
  return w, tonumber(e), tonumber(x), t
end

local function pack_lease(w, e, x, t)
  return w .. '\t' .. fmt(e) .. '\t' .. fmt(x) .. '\t' .. t
end

local function hmget(key, fields)
  local n = #fields
  if n == 0 then
    return {}
  end
  if n <= CHUNK then
    return redis.call('HMGET', key, unpack(fields))
  end
  local out = {}
  for s = 1, n, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, s, math.min(s + CHUNK - 1, n)))
    for k = 1, #part do
      out[s + k - 1] = part[k]
    end
  end
  return out
end

-- call `cmd key items...` in chunks (HSET with field/value pairs: keep CHUNK even)
local function multi(cmd, key, items)
  local n = #items
  for s = 1, n, CHUNK do
    redis.call(cmd, key, unpack(items, s, math.min(s + CHUNK - 1, n)))
  end
end

-- forget the block -> artifact mapping of `id`'s blocks that still point at it
local function unmap(own_key, id, hex)
  if not hex or hex == '' then
    return
  end
  local blocks = split16(hex)
  local cur = hmget(own_key, blocks)
  local dels = {}
  for i = 1, #blocks do
    if cur[i] == id then
      dels[#dels + 1] = blocks[i]
    end
  end
  multi('HDEL', own_key, dels)
end

local function delete_artifact(id, worker)
  local ak = P .. 'a:' .. id
  unmap(P .. 'own', id, redis.call('HGET', ak, 'blocks'))
  redis.call('HDEL', P .. 'art', id)
  redis.call('DEL', ak)
  redis.call('SREM', P .. 'w:' .. worker .. ':arts', id)
end

-- cached-tier byte of worker index j in block b's value v (one byte per worker)
local function write_byte(cache_key, b, v, j, nv)
  v = v or ''
  if #v < j then
    v = v .. string.rep('\0', j - #v)
  end
  v = string.sub(v, 1, j - 1) .. string.char(nv) .. string.sub(v, j + 1)
  if string.find(v, '[^%z]') then
    redis.call('HSET', cache_key, b, v)
  else
    redis.call('HDEL', cache_key, b)
  end
end

-- drop worker's whole cached view (resync / AllBlocksCleared / death); returns blocks cleared
local function clear_cached(worker, j)
  local ehk = P .. 'w:' .. worker .. ':eh'
  local cache_key = P .. 'cache'
  local vals = redis.call('HVALS', ehk)
  local n = 0
  for _, b in ipairs(vals) do
    local v = redis.call('HGET', cache_key, b)
    if v and (string.byte(v, j) or 0) ~= 0 then
      n = n + 1
      write_byte(cache_key, b, v, j, 0)
    end
  end
  redis.call('DEL', ehk)
  return n
end
