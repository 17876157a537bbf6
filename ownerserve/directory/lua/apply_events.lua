-- apply_events: one KV event batch of a worker, with gap detection. KEYS: w:<worker>,
-- w:<worker>:eh, cache. ARGV: P, worker, root (hex), block size, seq, then ops:
--   'S', tier bit, parent engine hash ('' at chain start), parent block (hex), blocks hex, engine csv
--   'R', tier bit, engine csv        'C'        'X', n (blocks the client could not map)
local info = redis.call('HMGET', KEYS[1], 'idx', 'seq', 'root', 'bs')
if not info[1] or not info[3] then
  return { 'unknown' }
end
if info[3] ~= ARGV[3] or info[4] ~= ARGV[4] then
  return { 'reregistered' }
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
  clear_cached(worker, j)
end
local cache_key = KEYS[3]
local stored, removed, skipped = 0, 0, 0
local i = 6
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local bitv = tonumber(ARGV[i + 1])
    local pe, po = ARGV[i + 2], ARGV[i + 3]
    local blocks = split16(ARGV[i + 4])
    local ehs = split_csv(ARGV[i + 5])
    if pe == '' or redis.call('HGET', KEYS[2], pe) == po then
      local cur = hmget(cache_key, blocks)
      local pairs_ = {}
      for k = 1, #blocks do
        local v = cur[k]
        local c = v and (string.byte(v, j) or 0) or 0
        local nv = bit.bor(c, bitv)
        if nv ~= c then
          write_byte(cache_key, blocks[k], v, j, nv)
        end
        pairs_[#pairs_ + 1] = ehs[k]
        pairs_[#pairs_ + 1] = blocks[k]
        stored = stored + 1
      end
      multi('HSET', KEYS[2], pairs_)
    else
      skipped = skipped + #blocks
    end
    i = i + 6
  elseif op == 'R' then
    local bitv = tonumber(ARGV[i + 1])
    for _, e in ipairs(split_csv(ARGV[i + 2])) do
      local b = redis.call('HGET', KEYS[2], e)
      if b then
        local v = redis.call('HGET', cache_key, b)
        local c = v and (string.byte(v, j) or 0) or 0
        local nv = bit.band(c, bit.bnot(bitv))
        if nv ~= c then
          removed = removed + 1
          write_byte(cache_key, b, v, j, nv)
        end
        if nv == 0 then
          redis.call('HDEL', KEYS[2], e)
        end
      end
    end
    i = i + 3
  elseif op == 'C' then
    clear_cached(worker, j)
    i = i + 1
  elseif op == 'X' then
    skipped = skipped + tonumber(ARGV[i + 1])
    i = i + 2
  else
    return redis.error_reply('apply_events: unknown op ' .. tostring(op))
  end
end
redis.call('HSET', KEYS[1], 'seq', seq)
return { 'ok', stored, removed, gap, expected, skipped }
