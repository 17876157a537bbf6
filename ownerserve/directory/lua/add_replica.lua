-- add_replica: a read-only copy on a worker/tier that expires. KEYS: rep
-- ARGV: P, id, worker, tier, ttl_ms, read_only (0/1), blocks hex ('' = the artifact's own blocks)
local now = now_ms()
local blocks
if ARGV[7] == '' then
  local bh = redis.call('HGET', P .. 'a:' .. ARGV[2], 'blocks')
  if bh then
    blocks = split16(bh)
  else
    blocks = { ARGV[2] }
  end
else
  blocks = split16(ARGV[7])
end
local worker, tier = ARGV[3], ARGV[4]
local entry = worker .. '\t' .. tier .. '\t' .. fmt(now + tonumber(ARGV[5])) .. '\t' .. ARGV[6] .. '\n'
local cur = hmget(KEYS[1], blocks)
local sets = {}
for i = 1, #blocks do
  local keep = {}
  local r = cur[i]
  if r then
    for line in string.gmatch(r, '[^\n]*\n') do
      local w, t, x = string.match(line, '^(.*)\t(%a+)\t(%d+)\t[01]\n$')
      if w and tonumber(x) > now and not (w == worker and t == tier) then
        keep[#keep + 1] = line
      end
    end
  end
  keep[#keep + 1] = entry
  sets[#sets + 1] = blocks[i]
  sets[#sets + 1] = table.concat(keep)
end
multi('HSET', KEYS[1], sets)
multi('SADD', P .. 'w:' .. worker .. ':reps', blocks)
return 1
