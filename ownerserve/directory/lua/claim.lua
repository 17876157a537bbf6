-- claim: make a worker owner of an artifact's free blocks, with a fresh fencing epoch.
-- KEYS: own, art, epoch
-- ARGV: P, id, worker, lease_ms, tier, size, kv_type, start, blocks hex (chain[start:]),
--       fence epoch ('' = none), fence block (chain[start-1])
local id, worker = ARGV[2], ARGV[3]
local lease_ms = tonumber(ARGV[4])
local now = now_ms()
local function live(aid)
  if not aid then
    return nil
  end
  local rec = redis.call('HGET', KEYS[2], aid)
  if not rec then
    return nil
  end
  local w, e, x, t = parse_lease(rec)
  if x > now then
    return w, e, x, t
  end
  return nil
end

if ARGV[10] ~= '' then
  local w, e = live(redis.call('HGET', KEYS[1], ARGV[11]))
  if w ~= worker or e ~= tonumber(ARGV[10]) then
    return { 'stale', e or 0 }
  end
end

local holder = redis.call('HGET', KEYS[1], id)
local w, e, x, t = live(holder)
if w then
  if w == worker and holder == id then
    local nx = math.max(x, now + lease_ms)
    if nx ~= x then
      redis.call('HSET', KEYS[2], id, pack_lease(w, e, nx, t))
    end
    return { 'ok', id, w, e, nx }
  end
  return { 'held', holder, w, e, x }
end

local old = redis.call('HGET', KEYS[2], id)
if old then
  delete_artifact(id, (parse_lease(old)))
end
local epoch = redis.call('INCR', KEYS[3])
local exp = now + lease_ms
redis.call('HSET', KEYS[2], id, pack_lease(worker, epoch, exp, ARGV[5]))
local blocks = split16(ARGV[9])
local cur = hmget(KEYS[1], blocks)
local alive = {}
local sets = {}
for i = 1, #blocks do
  local c = cur[i]
  local take = true
  if c and c ~= id then
    local l = alive[c]
    if l == nil then
      l = live(c) ~= nil
      alive[c] = l
    end
    take = not l
  end
  if take then
    sets[#sets + 1] = blocks[i]
    sets[#sets + 1] = id
  end
end
multi('HSET', KEYS[1], sets)
local ak = P .. 'a:' .. id
redis.call('HSET', ak, 'worker', worker, 'epoch', epoch, 'start', ARGV[8], 'n', #blocks,
  'size', ARGV[6], 'kv', ARGV[7], 'tier', ARGV[5], 'created', fmt(now), 'last', fmt(now),
  'blocks', ARGV[9])
redis.call('HSETNX', ak, 'reuse', 0)
redis.call('SADD', P .. 'w:' .. worker .. ':arts', id)
return { 'ok', id, worker, epoch, exp }
