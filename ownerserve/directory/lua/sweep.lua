-- sweep: one HSCAN step over leases and replicas, deleting what expired. KEYS: art, rep
-- ARGV: P, lease cursor ('-' = done), replica cursor ('-' = done), count
local now = now_ms()
local dropped = 0
local c1, c2 = '-', '-'
if ARGV[2] ~= '-' then
  local res = redis.call('HSCAN', KEYS[1], ARGV[2], 'COUNT', ARGV[4])
  c1 = res[1]
  local kv = res[2]
  for k = 1, #kv, 2 do
    local w, _, x = parse_lease(kv[k + 1])
    if x <= now then
      delete_artifact(kv[k], w)
      dropped = dropped + 1
    end
  end
end
if ARGV[3] ~= '-' then
  local res = redis.call('HSCAN', KEYS[2], ARGV[3], 'COUNT', ARGV[4])
  c2 = res[1]
  local kv = res[2]
  for k = 1, #kv, 2 do
    local keep, gone = {}, 0
    for line in string.gmatch(kv[k + 1], '[^\n]*\n') do
      local x = string.match(line, '^.*\t%a+\t(%d+)\t[01]\n$')
      if x and tonumber(x) > now then
        keep[#keep + 1] = line
      else
        gone = gone + 1
      end
    end
    if gone > 0 then
      dropped = dropped + gone
      if #keep > 0 then
        redis.call('HSET', KEYS[2], kv[k], table.concat(keep))
      else
        redis.call('HDEL', KEYS[2], kv[k])
      end
    end
  end
end
return { c1, c2, dropped }
