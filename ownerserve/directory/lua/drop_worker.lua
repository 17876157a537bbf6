-- drop_worker: owner death, in steps bounded by the entries they touch (Redis serves nothing
-- else while a script runs; a worker may hold 10^5 entries). Its leases end, replicas and
-- cached view go, its sessions lose their owner, its event seq resets, its life count goes up,
-- its replica holders' leases end (their records kept at expiry 0: an ended incarnation is
-- never revived, and its lines go with the moved `:reps` set).
-- KEYS: blk, w:<worker>. ARGV: P, worker, life, entries.
-- life: '' = any, else the count the caller saw while the worker lived; past it (that life
-- was dropped already, the worker may be back and recording) nothing new starts; '+' = only
-- go on with a drop under way. A drop that starts counts the life and moves the worker's
-- index sets (`:arts`, `:reps`, `:sess`, `:eh`) aside under `:d<life>:` at once (RENAME is
-- O(1)), so what the worker records from then on is its next life's and no step touches it;
-- each step then undoes the entries of one moved set, until ARGV[4] entries are spent
-- (after one entry at least). An entry the next life recorded again (its artifact, replica
-- block or session back in the live set) is left to it. The caller calls again with '+'
-- while steps are left: a drop cut short (the caller died) goes on at the worker's next drop.
-- Returns { dropped (-1: fenced), 1 if steps are left else 0 }.
local worker = ARGV[2]
local wp = P .. 'w:' .. worker
local pending = wp .. ':drops'
local SETS = { 'arts', 'reps', 'sess', 'eh' }
local fenced = false
if ARGV[3] ~= '+' then
  local life = tonumber(redis.call('HGET', KEYS[2], 'life') or '0')
  if ARGV[3] ~= '' and life > tonumber(ARGV[3]) then
    fenced = true
  else
    redis.call('HSET', KEYS[2], 'life', life + 1)
    redis.call('HDEL', KEYS[2], 'seq')
    for _, s in ipairs(SETS) do
      if redis.call('EXISTS', wp .. ':' .. s) == 1 then
        redis.call('RENAME', wp .. ':' .. s, wp .. ':d' .. life .. ':' .. s)
      end
    end
    redis.call('SADD', pending, life)
    for _, tier in ipairs({ 'gpu', 'cpu', 'ssd' }) do
      local f = worker .. '\t' .. tier
      local cur = redis.call('HGET', HOLD, f)
      if cur then
        redis.call('HSET', HOLD, f, string.match(cur, '^(%d+)') .. '\t0')
        redis.call('ZREM', HX, f)
        redis.call('HDEL', HXC, f)
      end
    end
  end
end

local budget = tonumber(ARGV[4])
local PAGE = 64
local dropped, spent = 0, 0
local j = tonumber(redis.call('HGET', KEYS[2], 'idx') or '0')

-- each moved set's handler: undo `members` (popped from it); returns the entries spent
local undo = {
  arts = function(ids)
    local cost = 0
    for _, id in ipairs(ids) do
      cost = cost + 1
      local rec = redis.call('HGET', P .. 'art', id)
      if rec and parse_lease(rec) == worker
        and redis.call('SISMEMBER', wp .. ':arts', id) == 0 then
        cost = cost + math.floor(redis.call('HSTRLEN', P .. 'a:' .. id, 'blocks') / 16)
        delete_artifact(id, worker)
        dropped = dropped + 1
      end
    end
    return cost
  end,
  reps = function(blocks)
    local mine = {}
    for _, b in ipairs(blocks) do
      if redis.call('SISMEMBER', wp .. ':reps', b) == 0 then
        mine[#mine + 1] = b
      end
    end
    update_blocks(mine, function(_, own, cache, reps)
      local keep, gone = reps_without(reps, worker, nil)
      if gone > 0 then
        dropped = dropped + gone
        return own, cache, keep
      end
    end)
    return #blocks
  end,
  sess = function(sids)
    for _, sid in ipairs(sids) do
      local k = P .. 's:' .. sid
      if redis.call('GET', k) == worker and redis.call('SISMEMBER', wp .. ':sess', sid) == 0 then
        redis.call('DEL', k)
        dropped = dropped + 1
      end
    end
    return #sids
  end,
  eh = function(blocks)
    dropped = dropped + uncache(blocks, j)
    return #blocks
  end,
}

-- take up to n members off a moved set (SPOP), or a page of a moved `:eh` hash's values
local function take(key, s, n)
  if s ~= 'eh' then
    return redis.call('SPOP', key, n)
  end
  return take_hash_page(key, n)
end

-- a step spends at least 1 an attempt, so every call ends and every step makes progress
while spent < budget do
  local life = redis.call('SRANDMEMBER', pending)
  if not life then
    break
  end
  for _, s in ipairs(SETS) do
    local key = wp .. ':d' .. life .. ':' .. s
    while spent < budget and redis.call('EXISTS', key) == 1 do
      local members = take(key, s, math.min(PAGE, math.max(1, budget - spent)))
      spent = spent + math.max(1, undo[s](members))
    end
  end
  local gone = true
  for _, s in ipairs(SETS) do
    gone = gone and redis.call('EXISTS', wp .. ':d' .. life .. ':' .. s) == 0
  end
  if gone then
    redis.call('DEL', wp .. ':d' .. life .. ':ehc')  -- emptied by HDEL before its round ended
    redis.call('SREM', pending, life)
  end
end
local more = redis.call('SCARD', pending) > 0 and 1 or 0
if fenced then
  return { -1, more }
end
return { dropped, more }
