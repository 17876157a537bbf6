-- transfer: after a state migration, hand a prefix over from one worker to another. Every live
-- artifact of `from` whose blocks all lie in the chain becomes `to`'s, at one new epoch, with a
-- new lease; `from` keeps a read-only replica of the chain. Block records keep naming the same
-- artifact ids, so only the leases, the metadata, the per-worker `:arts` sets and the expiry
-- hints change (plus the replica lines, written in the same pass that reads the owners).
-- KEYS: blk, art, epoch. ARGV: P, chain hex, from, to, lease_ms, replica ttl_ms, replica tier
-- Reply: { blocks that changed owner, new epoch (0: none moved), id, expires_ms, id, ... }
local blocks = split16(ARGV[2])
local from, to, tier = ARGV[3], ARGV[4], ARGV[7]
local now = now_ms()
local rep_exp = now + tonumber(ARGV[6])
local entry = from .. '\t' .. tier .. '\t' .. fmt(rep_exp) .. '\t1\n'
local owner_at, ids, seen = {}, {}, {}
update_blocks(blocks, function(i, own, cache, reps)
  if own then
    owner_at[i] = own
    if not seen[own] then
      seen[own] = true
      ids[#ids + 1] = own
    end
  end
  return own, cache, put_replica(blocks[i], reps, from, tier, entry, now)
end)
multi('SADD', P .. 'w:' .. from .. ':reps', blocks)
hint_reps(blocks, rep_exp)

-- a live artifact always maps its own last block, so the chain's owners name every artifact
-- that lies in it; one reaching past the chain stays with `from`
local in_chain = {}
for _, b in ipairs(blocks) do
  in_chain[b] = true
end
local leases = hmget(KEYS[2], ids)
local moving, tiers = {}, {}
for k, id in ipairs(ids) do
  if leases[k] then
    local w, _, x, t = parse_lease(leases[k])
    if w == from and x > now then
      local inside = true
      for _, b in ipairs(split16(redis.call('HGET', P .. 'a:' .. id, 'blocks') or id)) do
        if not in_chain[b] then
          inside = false
          break
        end
      end
      if inside then
        moving[#moving + 1] = id
        tiers[id] = t
      end
    end
  end
end
if #moving == 0 then
  return { 0, 0 }
end
local epoch = redis.call('INCR', KEYS[3])
local exp = now + tonumber(ARGV[5])
local reply = { 0, epoch }
for _, id in ipairs(moving) do
  redis.call('HSET', KEYS[2], id, pack_lease(to, epoch, exp, tiers[id]))
  hint_lease(id, exp)
  redis.call('HSET', P .. 'a:' .. id, 'worker', to, 'epoch', epoch)
  redis.call('SREM', P .. 'w:' .. from .. ':arts', id)
  redis.call('SADD', P .. 'w:' .. to .. ':arts', id)
  reply[#reply + 1] = id
  reply[#reply + 1] = exp
end
local changed = 0
for i = 1, #blocks do
  if owner_at[i] and tiers[owner_at[i]] then
    changed = changed + 1
  end
end
reply[1] = changed
return reply
