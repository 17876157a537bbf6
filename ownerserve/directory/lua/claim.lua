-- claim: make a worker owner of an artifact's free blocks, with a fresh fencing epoch.
-- KEYS: blk, art, epoch
-- ARGV: P, id, worker, lease_ms, tier, size, kv_type, start, blocks hex (chain[start:]),
--       fence epoch ('' = none), fence block (chain[start-1])
local id, worker = ARGV[2], ARGV[3]
local lease_ms = tonumber(ARGV[4])
local now = now_ms()
local function live(aid)
  if not aid or aid == '' then
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
  local w, e = live((rec_parse(redis.call('HGET', KEYS[1], ARGV[11]))))
  if w ~= worker or e ~= tonumber(ARGV[10]) then
    return { 'stale', e or 0 }
  end
end

local holder = rec_parse(redis.call('HGET', KEYS[1], id))
local w, e, x, t = live(holder)
if w then
  if w == worker and holder == id then
    local nx = math.max(x, now + lease_ms)
    if nx ~= x then
      redis.call('HSET', KEYS[2], id, pack_lease(w, e, nx, t))
      hint_lease(id, nx)
    end
    return { 'ok', id, w, e, nx }
  end
  return { 'held', holder, w, e, x }
end

local old = redis.call('HGET', KEYS[2], id)
if old then
  delete_artifact(id, (parse_lease(old)), true) -- an expired lease: its reuse count stays
end
local epoch = redis.call('INCR', KEYS[3])
local exp = now + lease_ms
redis.call('HSET', KEYS[2], id, pack_lease(worker, epoch, exp, ARGV[5]))
hint_lease(id, exp)
local blocks = split16(ARGV[9])
local alive = {}
update_blocks(blocks, function(_, own, cache, reps)
  if own and own ~= id then
    local l = alive[own]
    if l == nil then
      l = live(own) ~= nil
      alive[own] = l
    end
    if l then
      return nil -- a live artifact holds this block: it stays there
    end
  end
  return id, cache, reps
end)
redis.call('HSET', P .. 'a:' .. id, 'worker', worker, 'epoch', epoch, 'start', ARGV[8],
  'n', #blocks, 'size', ARGV[6], 'kv', ARGV[7], 'tier', ARGV[5], 'created', fmt(now),
  'blocks', ARGV[9])
redis.call('HSETNX', P .. 'last', id, fmt(now))
redis.call('SADD', P .. 'w:' .. worker .. ':arts', id)
return { 'ok', id, worker, epoch, exp }
