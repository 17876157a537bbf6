-- Prepended to every OwnerServe directory script. ARGV[1] is the key prefix "{ns}:"; every
-- key a script touches starts with it, so all of them hash to one Redis Cluster slot.
if redis.replicate_commands then redis.replicate_commands() end
local P = ARGV[1]
local CHUNK = 4000 -- stays below Lua's unpack() limit

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x)
  return string.format('%d', x)
end

-- "16 hex digits per block" -> list of block field names
local function split16(hex)
  local out = {}
  for i = 1, #hex, 16 do
    out[#out + 1] = string.sub(hex, i, i + 15)
  end
  return out
end

local function split_csv(csv)
  local out = {}
  for s in string.gmatch(csv, '[^,]+') do
    out[#out + 1] = s
  end
  return out
end

-- lease record in the `art` hash: "worker \t epoch \t expires_ms \t tier"
local function parse_lease(rec)
  local w, e, x, t = string.match(rec, '^([^\t]*)\t(%d+)\t(%d+)\t(%a+)$')
  return w, tonumber(e), tonumber(x), t
end

local function pack_lease(w, e, x, t)
  return w .. '\t' .. fmt(e) .. '\t' .. fmt(x) .. '\t' .. t
end

local function hmget(key, fields)
  local n = #fields
  if n == 0 then
    return {}
  end
  if n <= CHUNK then
    return redis.call('HMGET', key, unpack(fields))
  end
  local out = {}
  for s = 1, n, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, s, math.min(s + CHUNK - 1, n)))
    for k = 1, #part do
      out[s + k - 1] = part[k]
    end
  end
  return out
end

-- call `cmd key items...` in chunks (HSET with field/value pairs: keep CHUNK even)
local function multi(cmd, key, items)
  local n = #items
  for s = 1, n, CHUNK do
    redis.call(cmd, key, unpack(items, s, math.min(s + CHUNK - 1, n)))
  end
end

-- per-block record in the `blk` hash, one HMGET reads a whole chain:
--   owner artifact id (16 hex digits, or NOOWN) .. cached bytes (byte j = tier bits of worker j)
--   .. '\n' .. replica lines "worker \t tier \t expires_ms \t read_only \n"
-- tier bits are 1, 2, 4, so a cached byte is never '\n'
local BLK = P .. 'blk'
local NOOWN = '----------------'

local function rec_parse(v)
  if not v then
    return false, '', ''
  end
  local nl = string.find(v, '\n', 17, true)
  local own = string.sub(v, 1, 16)
  if own == NOOWN then
    own = false
  end
  return own, string.sub(v, 17, nl - 1), string.sub(v, nl + 1)
end

local function rec_pack(own, cache, reps)
  cache = string.gsub(cache, '%z+$', '')
  if not own and cache == '' and reps == '' then
    return false
  end
  return (own or NOOWN) .. cache .. '\n' .. reps
end

local function cache_set(cache, j, nv)
  if #cache < j then
    cache = cache .. string.rep('\0', j - #cache)
  end
  return string.sub(cache, 1, j - 1) .. string.char(nv) .. string.sub(cache, j + 1)
end

-- the GPU-cached blocks over every worker, kept as cached bytes change (`update_blocks`, the
-- one writer of block records): field d, blocks some worker caches on GPU; c, (block, worker)
-- GPU pairs. Read by `RedisDirectory.cached_counts` (one HMGET)
local KVN = P .. 'kvn'

-- how many workers a block's cached bytes say cache it on GPU (tier bit 1)
local function gpu_holders(cache)
  local n = 0
  for k = 1, #cache do
    if bit.band(string.byte(cache, k), 1) == 1 then
      n = n + 1
    end
  end
  return n
end

-- read-modify-write the records of `blocks`; fn(i, own, cache, reps) returns the new
-- (own, cache, reps), or nil to leave block i alone. A cached byte's GPU bit that changes
-- moves the counts in `kvn` (one HINCRBY per call and field, none when none moved)
local function update_blocks(blocks, fn)
  local cur = hmget(BLK, blocks)
  local sets, dels = {}, {}
  local dd, dc = 0, 0
  for i = 1, #blocks do
    local own, cache, reps = rec_parse(cur[i])
    local o2, c2, r2 = fn(i, own, cache, reps)
    if o2 ~= nil then
      if c2 ~= cache then
        local before, after = gpu_holders(cache), gpu_holders(c2)
        if before ~= after then
          dc = dc + after - before
          if before == 0 then
            dd = dd + 1
          elseif after == 0 then
            dd = dd - 1
          end
        end
      end
      local v = rec_pack(o2, c2, r2)
      if v ~= cur[i] then
        if v then
          sets[#sets + 1] = blocks[i]
          sets[#sets + 1] = v
        else
          dels[#dels + 1] = blocks[i]
        end
      end
    end
  end
  multi('HSET', BLK, sets)
  multi('HDEL', BLK, dels)
  if dd ~= 0 then
    redis.call('HINCRBY', KVN, 'd', dd)
  end
  if dc ~= 0 then
    redis.call('HINCRBY', KVN, 'c', dc)
  end
end

-- forget the owner of `id`'s blocks that still point at it
local function unmap(id, hex)
  if not hex or hex == '' then
    return
  end
  update_blocks(split16(hex), function(_, own, cache, reps)
    if own == id then
      return false, cache, reps
    end
  end)
end

-- expiry hints for `sweep`: `lx` (artifact id -> lease expiry ms); `rx` (one per replica
-- write: its number -> expiry ms, its blocks in the `rxb` hash); `sx` ("worker \t session" ->
-- the session's expiry) and `fx` ("artifact id \t session" of a fork ref -> its session's
-- expiry). Hints only: the records stay the truth, and the sweep mends a hint that is early (a
-- renewal it missed) or stale. A replica line renewed is written again, with its own hint.
local LX, RX, RXB, SX, FX = P .. 'lx', P .. 'rx', P .. 'rxb', P .. 'sx', P .. 'fx'

-- when session `sid` ends (ms): now if it has no owner
local function session_end(sid, now)
  local ttl = redis.call('PTTL', P .. 's:' .. sid)
  if ttl < 0 then
    return now
  end
  return now + ttl
end

local function hint_lease(id, x)
  redis.call('ZADD', LX, x, id)
end

-- one hint for a replica write over `blocks` expiring at x (per write, not per block: a
-- sorted-set member per block cost Redis ~2 us each)
local function hint_reps(blocks, x)
  local n = redis.call('INCR', P .. 'rxn')
  redis.call('ZADD', RX, x, n)
  redis.call('HSET', RXB, n, table.concat(blocks))
end

local function delete_artifact(id, worker, keep_use)
  local ak = P .. 'a:' .. id
  unmap(id, redis.call('HGET', ak, 'blocks'))
  redis.call('HDEL', P .. 'art', id)
  redis.call('ZREM', LX, id)
  redis.call('DEL', ak)
  if not keep_use then
    redis.call('HDEL', P .. 'reuse', id)
    redis.call('HDEL', P .. 'last', id)
  end
  redis.call('SREM', P .. 'w:' .. worker .. ':arts', id)
end

-- drop a worker's whole cached view (a gap in its events, AllBlocksCleared, a new chain root)
-- in steps (`clear_step.lua`): its `:eh` hash moves aside (RENAME is O(1)) as a pending clear
-- `w:<worker>:clr<n>`, listed in `w:<worker>:clears`, so the events applied from then on build
-- the new view in a fresh `:eh`. A block they store is listed in `w:<worker>:clrfresh` the
-- first time (its old bits go then: `take_fresh`), and the steps clear the bits of the rest;
-- a later clear empties that list (what it held is in the `:eh` set aside by then)
local function defer_clear(worker)
  local wp = P .. 'w:' .. worker
  redis.call('DEL', wp .. ':clrfresh')
  if redis.call('EXISTS', wp .. ':eh') == 0 then
    return
  end
  local n = redis.call('INCR', P .. 'clrn')
  redis.call('RENAME', wp .. ':eh', wp .. ':clr' .. n)
  redis.call('SADD', wp .. ':clears', n)
end

-- for `blocks` the worker stores: true at k where a clear is pending and blocks[k] is stored
-- for the first time since the latest one (listed now: the steps leave it alone)
local function take_fresh(worker, blocks)
  local wp = P .. 'w:' .. worker
  local fresh = {}
  if redis.call('EXISTS', wp .. ':clears') == 0 then
    return fresh
  end
  local fk, new = wp .. ':clrfresh', {}
  for k = 1, #blocks do
    if redis.call('SISMEMBER', fk, blocks[k]) == 0 then
      fresh[k] = true
      new[#new + 1] = blocks[k]
    end
  end
  multi('SADD', fk, new)
  return fresh
end

-- take up to n values off a hash set aside (a page of HSCAN, its cursor kept beside it as
-- key .. 'c': a full round returns every field; the hash and its cursor go after it)
local function take_hash_page(key, n)
  local ck = key .. 'c'
  local page = redis.call('HSCAN', key, redis.call('GET', ck) or '0', 'COUNT', n)
  local fields, values = {}, {}
  for i = 1, #page[2], 2 do
    fields[#fields + 1] = page[2][i]
    values[#values + 1] = page[2][i + 1]
  end
  if page[1] == '0' then
    redis.call('DEL', key, ck)
  else
    redis.call('SET', ck, page[1])
    multi('HDEL', key, fields)
  end
  return values
end

-- the worker with byte index j caches none of `blocks` any more; returns the blocks cleared
local function uncache(blocks, j)
  local uniq, seen = {}, {}
  for _, b in ipairs(blocks) do
    if not seen[b] then
      seen[b] = true
      uniq[#uniq + 1] = b
    end
  end
  local n = 0
  if j > 0 then
    update_blocks(uniq, function(_, own, cache, reps)
      if (string.byte(cache, j) or 0) ~= 0 then
        n = n + 1
        return own, cache_set(cache, j, 0), reps
      end
    end)
  end
  return n
end

-- replica holders (`renew_replica_holder`, `holder.lua`): `hold` hash "worker \t tier" ->
-- "incarnation \t expires_ms", one record per holder however many lines it holds; a held
-- replica line's expiry field is 'h' .. incarnation, and it lives while its holder's record
-- does at that incarnation. `hx` hints each holder's expiry for `sweep_due` ("worker \t tier"
-- -> expires_ms, or now where a purge of a superseded incarnation's lines is due); `hxc` holds
-- the cursor of a purge under way (an SSCAN of the worker's `:reps` set)
local HOLD, HX, HXC = P .. 'hold', P .. 'hx', P .. 'hxc'
local holders_cache = nil

-- "worker \t tier" -> incarnation of each holder live at `now` (read once per script call)
local function live_holders(now)
  if not holders_cache then
    holders_cache = {}
    local kv = redis.call('HGETALL', HOLD)
    for k = 1, #kv, 2 do
      local inc, x = string.match(kv[k + 1], '^(%d+)\t(%d+)$')
      if inc and tonumber(x) > now then
        holders_cache[kv[k]] = inc
      end
    end
  end
  return holders_cache
end

-- whether a replica line of worker `w` in tier `t` with expiry field `x` counts at `now`
local function line_live(w, t, x, now)
  if string.byte(x, 1) == 104 then -- 'h': a held line
    return live_holders(now)[w .. '\t' .. t] == string.sub(x, 2)
  end
  return tonumber(x) > now
end

-- replica lines without those of `worker` (and, given `now`, without dead ones)
-- workers of the `lost` lines with none `kept` in the record: their `w:<worker>:reps` sets
-- still list it (`kept` is a set of workers; it is extended)
local function orphans_of(lost, kept)
  local orphans = {}
  for _, w in ipairs(lost) do
    if not kept[w] then
      kept[w] = true
      orphans[#orphans + 1] = w
    end
  end
  return orphans
end

local function reps_without(reps, worker, now)
  local keep, gone, lost, kept = {}, 0, {}, {}
  for line in string.gmatch(reps, '[^\n]*\n') do
    local w, t, x = string.match(line, '^([^\t]*)\t(%a+)\t(h?%d+)\t[01]\n$')
    if w == worker or (now and not line_live(w, t, x, now)) then
      gone = gone + 1
      lost[#lost + 1] = w
    else
      keep[#keep + 1] = line
      kept[w] = true
    end
  end
  return table.concat(keep), gone, orphans_of(lost, kept)
end

-- forget `block` in the `:reps` sets of `workers`
local function unindex_reps(block, workers)
  for _, w in ipairs(workers) do
    redis.call('SREM', P .. 'w:' .. w .. ':reps', block)
  end
end

-- drop the dead replica lines of `blocks` (unlisting them from their workers' `:reps`
-- sets). Returns the lines dropped.
local function prune_reps(blocks, now)
  local dropped = 0
  update_blocks(blocks, function(i, own, cache, reps)
    local keep, gone, orphans = reps_without(reps, nil, now)
    if gone > 0 then
      dropped = dropped + gone
      unindex_reps(blocks[i], orphans)
      return own, cache, keep
    end
  end)
  return dropped
end

-- `reps` (the replica lines of `block`) with `entry`, the line of `worker` in `tier`, in place
-- of that worker's old line in that tier and of every dead line; the block leaves the
-- `:reps` sets of the workers whose expired lines went and who keep none in it
local function put_replica(block, reps, worker, tier, entry, now)
  local keep, lost, kept = {}, {}, { [worker] = true }
  for line in string.gmatch(reps, '[^\n]*\n') do
    local w, t, x = string.match(line, '^([^\t]*)\t(%a+)\t(h?%d+)\t[01]\n$')
    if w and line_live(w, t, x, now) and not (w == worker and t == tier) then
      keep[#keep + 1] = line
      kept[w] = true
    elseif w then
      lost[#lost + 1] = w
    end
  end
  keep[#keep + 1] = entry
  unindex_reps(block, orphans_of(lost, kept))
  return table.concat(keep)
end
