-- sweep_index: one SSCAN step over an index set, dropping members that point at nothing live.
-- KEYS: the set (`w:<worker>:sess` or `forks`). ARGV: P, 'sess'|'forks', worker, cursor, count
-- sess: sessions no longer owned by the worker (expired or moved on); forks: fork refs of
-- sessions that ended, and the ids left without refs. What stays gets its expiry hint (`sx`,
-- `fx`: the sweeps between full scans follow them). Returns { cursor, members removed }.
local now = now_ms()
local res = redis.call('SSCAN', KEYS[1], ARGV[4], 'COUNT', ARGV[5])
local removed = 0
if ARGV[2] == 'sess' then
  for _, sid in ipairs(res[2]) do
    if redis.call('GET', P .. 's:' .. sid) ~= ARGV[3] then
      redis.call('SREM', KEYS[1], sid)
      removed = removed + 1
    else
      redis.call('ZADD', SX, session_end(sid, now), ARGV[3] .. '\t' .. sid)
    end
  end
  if res[1] == '0' and redis.call('SCARD', KEYS[1]) == 0 then
    redis.call('SREM', P .. 'wsess', ARGV[3])
  end
else
  for _, id in ipairs(res[2]) do
    local fk = P .. 'f:' .. id
    for _, sid in ipairs(redis.call('SMEMBERS', fk)) do
      if redis.call('EXISTS', P .. 's:' .. sid) == 0 then
        redis.call('SREM', fk, sid)
        removed = removed + 1
      else
        redis.call('ZADD', FX, session_end(sid, now), id .. '\t' .. sid)
      end
    end
    if redis.call('SCARD', fk) == 0 then
      redis.call('SREM', KEYS[1], id)
    end
  end
end
return { res[1], removed }
