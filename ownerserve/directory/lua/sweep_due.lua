-- sweep_due: one step of the sweep by expiry hints (`lx`, `rx`, `sx`, `fx`; see common.lua):
-- up to ARGV[2] due hints of each. Deletes what expired (leases, replica lines: counted) and
-- the index entries of what ended (sessions in their workers' `:sess` sets, fork refs of ended
-- sessions), mends a hint that was early (renewed since: its real expiry), drops a stale one.
-- A due replica write's hint goes once its blocks' expired lines are pruned.
-- KEYS: lx, rx, sx, fx. ARGV: P, count. Returns { hints handled, records dropped }.
local now = now_ms()
local n = tonumber(ARGV[2])
local handled, dropped = 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', LX, '-inf', now, 'LIMIT', 0, n)) do
  handled = handled + 1
  local rec = redis.call('HGET', P .. 'art', id)
  if not rec then
    redis.call('ZREM', LX, id)
  else
    local w, _, x = parse_lease(rec)
    if x <= now then
      delete_artifact(id, w)
      dropped = dropped + 1
    else
      hint_lease(id, x)
    end
  end
end
local blocks, seen = {}, {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', RX, '-inf', now, 'LIMIT', 0, n)) do
  handled = handled + 1
  for _, b in ipairs(split16(redis.call('HGET', RXB, id) or '')) do
    if not seen[b] then
      seen[b] = true
      blocks[#blocks + 1] = b
    end
  end
  redis.call('ZREM', RX, id)
  redis.call('HDEL', RXB, id)
end
dropped = dropped + prune_reps(blocks, now)
-- a due session or fork-ref hint ("owner \t session"): mended while alive(owner, session),
-- else the session leaves the owner's set (set_of(owner)), and the owner leaves `list` once
-- that set is empty
local function due_index(Z, alive, set_of, list)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', Z, '-inf', now, 'LIMIT', 0, n)) do
    handled = handled + 1
    local owner, sid = string.match(m, '^([^\t]*)\t(.*)$')
    if alive(owner, sid) then
      redis.call('ZADD', Z, session_end(sid, now), m)
    else
      local k = set_of(owner)
      redis.call('SREM', k, sid)
      redis.call('ZREM', Z, m)
      if redis.call('SCARD', k) == 0 then
        redis.call('SREM', list, owner)
      end
    end
  end
end
due_index(SX, function(w, sid)
  return redis.call('GET', P .. 's:' .. sid) == w
end, function(w)
  return P .. 'w:' .. w .. ':sess'
end, P .. 'wsess')
due_index(FX, function(_, sid)
  return redis.call('EXISTS', P .. 's:' .. sid) == 1
end, function(id)
  return P .. 'f:' .. id
end, P .. 'forks')
return { handled, dropped }
