-- apply_events: one KV event batch of a worker, with gap detection. KEYS: w:<worker>,
-- w:<worker>:eh, blk. ARGV: P, worker, root (hex), block size, seq, life ('' = any, else the
-- worker's life count the caller saw while it lived: once that life was dropped the batch was
-- published before the death and is refused, reply { 'fenced', life }), then ops:
--   'S', tier bit, parent engine hash ('' at chain start), parent block (hex), blocks hex, engine csv
--   'R', tier bit, engine csv        'C'        'X', n (blocks the client could not map: their
--   block size)        'Y', n (blocks whose parent the client's map and this worker's lack)
-- Reply: 'ok', stored, removed, gap, expected, skipped (every block not mapped), of those the
-- ones with an unknown parent, pending clears (a gap or 'C' drops the cached view in steps:
-- the caller runs `clear_step` while some are pending)
local info = redis.call('HMGET', KEYS[1], 'idx', 'seq', 'root', 'bs', 'life')
if not info[1] or not info[3] then
  return { 'unknown' }
end
if info[3] ~= ARGV[3] or info[4] ~= ARGV[4] then
  return { 'reregistered' }
end
local life = tonumber(info[5] or '0')
if ARGV[6] ~= '' and life > tonumber(ARGV[6]) then
  return { 'fenced', life }
end
local worker = ARGV[2]
local j = tonumber(info[1])
local seq = tonumber(ARGV[5])
local last = info[2] and tonumber(info[2])
if last and seq <= last then
  return { 'dup', last + 1 }
end
local gap, expected = 0, -1
if last and seq > last + 1 then
  gap, expected = 1, last + 1
  defer_clear(worker)
end
local stored, removed, skipped, parentless = 0, 0, 0, 0
local i = 7
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local bitv = tonumber(ARGV[i + 1])
    local pe, po = ARGV[i + 2], ARGV[i + 3]
    local blocks = split16(ARGV[i + 4])
    local ehs = split_csv(ARGV[i + 5])
    if pe == '' or redis.call('HGET', KEYS[2], pe) == po then
      local fresh = take_fresh(worker, blocks)
      update_blocks(blocks, function(k, own, cache, reps)
        local c = string.byte(cache, j) or 0
        local nv = bit.bor(fresh[k] and 0 or c, bitv)
        if nv ~= c then
          return own, cache_set(cache, j, nv), reps
        end
      end)
      local pairs_ = {}
      for k = 1, #blocks do
        pairs_[#pairs_ + 1] = ehs[k]
        pairs_[#pairs_ + 1] = blocks[k]
      end
      multi('HSET', KEYS[2], pairs_)
      stored = stored + #blocks
    else
      skipped = skipped + #blocks
      parentless = parentless + #blocks
    end
    i = i + 6
  elseif op == 'R' then
    -- the blocks of the engine hashes, each once, lose the tier bit in one pass; an engine
    -- hash whose block the worker no longer caches in any tier leaves its map
    local bitv = tonumber(ARGV[i + 1])
    local ehs = split_csv(ARGV[i + 2])
    local found = hmget(KEYS[2], ehs)
    local blocks, at, left = {}, {}, {}
    for k = 1, #ehs do
      local b = found[k]
      if b and not at[b] then
        blocks[#blocks + 1] = b
        at[b] = #blocks
      end
    end
    update_blocks(blocks, function(k, own, cache, reps)
      local c = string.byte(cache, j) or 0
      left[k] = bit.band(c, bit.bnot(bitv))
      if left[k] ~= c then
        removed = removed + 1
        return own, cache_set(cache, j, left[k]), reps
      end
    end)
    local gone = {}
    for k = 1, #ehs do
      local b = found[k]
      if b and left[at[b]] == 0 then
        gone[#gone + 1] = ehs[k]
      end
    end
    multi('HDEL', KEYS[2], gone)
    i = i + 3
  elseif op == 'C' then
    defer_clear(worker)
    i = i + 1
  elseif op == 'X' or op == 'Y' then
    skipped = skipped + tonumber(ARGV[i + 1])
    if op == 'Y' then
      parentless = parentless + tonumber(ARGV[i + 1])
    end
    i = i + 2
  else
    return redis.error_reply('apply_events: unknown op ' .. tostring(op))
  end
end
redis.call('HSET', KEYS[1], 'seq', seq)
local pending = redis.call('SCARD', P .. 'w:' .. worker .. ':clears')
return { 'ok', stored, removed, gap, expected, skipped, parentless, pending }
