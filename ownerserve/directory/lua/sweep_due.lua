-- sweep_due: one step of the sweep by expiry hints (`lx`, `rx`, `sx`, `fx`; see common.lua),
-- bounded by the entries it touches, not by hints: a hint costs 1 plus the block records it
-- reads and writes (an expired lease's chain, a replica write's blocks), and the step ends
-- once ARGV[2] entries are spent (after one hint at least), so one call stays ~ms however long
-- the chains; the client calls it again until no hint is due. Deletes what expired (leases,
-- replica lines: counted) and the index entries of what ended (sessions in their workers'
-- `:sess` sets, fork refs of ended sessions), mends a hint that was early (renewed since: its
-- real expiry), drops a stale one. A due replica write's hint goes once its blocks' expired
-- lines are pruned. Every hint handled leaves the due range, so a step makes progress, but for
-- a replica holder's (`hx`): a holder that lapsed, or whose superseded incarnation's lines are
-- to go, has its worker's `:reps` set scanned a page per turn (the cursor in `hxc`), its dead
-- lines pruned, and stays due until the scan ends (each page advances it); a live holder with
-- no purge due has its hint mended to its expiry.
-- KEYS: lx, rx, sx, fx, hx. ARGV: P, entries. Returns { hints handled, records dropped, entries }.
local now = now_ms()
local budget = tonumber(ARGV[2])
local PAGE = 64
local handled, dropped, spent = 0, 0, 0

-- handle(member) for the due members of Z, a page at a time, while the budget lasts;
-- handle returns the entries it touched
local function each_due(Z, handle)
  while spent < budget do
    local page = redis.call('ZRANGEBYSCORE', Z, '-inf', now, 'LIMIT', 0, PAGE)
    if #page == 0 then
      return
    end
    for _, m in ipairs(page) do
      handled = handled + 1
      spent = spent + handle(m)
      if spent >= budget then
        return
      end
    end
  end
end

each_due(LX, function(id)
  local rec = redis.call('HGET', P .. 'art', id)
  if not rec then
    redis.call('ZREM', LX, id)
    return 1
  end
  local w, _, x = parse_lease(rec)
  if x <= now then
    local cost = 1 + math.floor(redis.call('HSTRLEN', P .. 'a:' .. id, 'blocks') / 16)
    delete_artifact(id, w)
    dropped = dropped + 1
    return cost
  end
  hint_lease(id, x)
  return 1
end)
each_due(RX, function(id)
  local blocks, seen = {}, {}
  for _, b in ipairs(split16(redis.call('HGET', RXB, id) or '')) do
    if not seen[b] then
      seen[b] = true
      blocks[#blocks + 1] = b
    end
  end
  redis.call('ZREM', RX, id)
  redis.call('HDEL', RXB, id)
  dropped = dropped + prune_reps(blocks, now)
  return 1 + #blocks
end)
each_due(HX, function(f)
  local cur = redis.call('HGET', HOLD, f)
  local x = cur and tonumber(string.match(cur, '\t(%d+)$')) or 0
  local cursor = redis.call('HGET', HXC, f)
  if x > now and not cursor then
    redis.call('ZADD', HX, x, f)
    return 1
  end
  local worker = string.match(f, '^(.*)\t%a+$')
  local page = redis.call(
    'SSCAN', P .. 'w:' .. worker .. ':reps', cursor or '0', 'COUNT', math.max(1, budget - spent)
  )
  dropped = dropped + prune_reps(page[2], now)
  if page[1] ~= '0' then
    redis.call('HSET', HXC, f, page[1])
  else
    redis.call('HDEL', HXC, f)
    if x > now then
      redis.call('ZADD', HX, x, f)
    else
      redis.call('ZREM', HX, f) -- its record stays: that incarnation is never revived
    end
  end
  return 1 + #page[2]
end)
-- a due session or fork-ref hint ("owner \t session"): mended while alive(owner, session)
-- (to a time past now, so it leaves the due range), else the session leaves the owner's set
-- (set_of(owner)), and the owner leaves `list` once that set is empty
local function due_index(Z, alive, set_of, list)
  each_due(Z, function(m)
    local owner, sid = string.match(m, '^([^\t]*)\t(.*)$')
    if alive(owner, sid) then
      redis.call('ZADD', Z, math.max(session_end(sid, now), now + 1), m)
    else
      local k = set_of(owner)
      redis.call('SREM', k, sid)
      redis.call('ZREM', Z, m)
      if redis.call('SCARD', k) == 0 then
        redis.call('SREM', list, owner)
      end
    end
    return 1
  end)
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
return { handled, dropped, spent }
