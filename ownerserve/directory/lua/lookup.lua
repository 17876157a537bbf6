-- lookup: the records of a chain's blocks, run by run, and the leases of the artifacts they
-- name, plus the session owner; the client turns them into holdings (`RedisDirectory.
-- decode_lookup`), so the one Redis core shared by every router does only the reads.
-- KEYS: blk, art, hold [, s:<sid>]. ARGV: P, chain (16 hex digits per block)
-- Reply: session owner, server time (ms), runs (flat: last block index of the run, its record
-- or '' when its blocks have none), leases (flat: artifact id, lease record or ''), replica
-- holders (flat: "worker \t tier", "incarnation \t expires_ms"; only where a run has a held
-- line, whose expiry field starts with 'h': a cached byte is at most 7, never a tab)
local blocks = split16(ARGV[2])
local n = #blocks
local sess = false
if KEYS[4] then
  sess = redis.call('GET', KEYS[4])
end
local now = now_ms()
if n == 0 then
  return { sess, now, {}, {}, {} }
end
local held = false
local vals = hmget(KEYS[1], blocks)
local runs, ids, seen = {}, {}, {}
local s = 1
while s <= n do
  local v = vals[s]
  local e = s
  while e < n and vals[e + 1] == v do -- interned strings: a pointer comparison
    e = e + 1
  end
  runs[#runs + 1] = e
  if v then
    runs[#runs + 1] = v
    held = held or string.find(v, '\th', 17, true) ~= nil
    local own = string.sub(v, 1, 16)
    if own ~= NOOWN and not seen[own] then
      seen[own] = true
      ids[#ids + 1] = own
    end
  else
    runs[#runs + 1] = ''
  end
  s = e + 1
end
local leases = {}
if #ids > 0 then
  local recs = hmget(KEYS[2], ids)
  for k = 1, #ids do
    leases[#leases + 1] = ids[k]
    leases[#leases + 1] = recs[k] or ''
  end
end
local holders = {}
if held then
  holders = redis.call('HGETALL', KEYS[3])
end
return { sess, now, runs, leases, holders }
