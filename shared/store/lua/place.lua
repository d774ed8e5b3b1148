-- place.lua: pick the least-loaded live `ready` worker with room, charge it, return {id, url}.
--
-- KEYS[1]  the workers ZSET, `{<prefix>}:workers` (worker id -> load score)
-- ARGV[1]  the worker hash key prefix, `{<prefix>}:worker:` (hash key = ARGV[1] .. id)
-- ARGV[2]  now, ms since the epoch, from the caller's clock
-- ARGV[3]  max heartbeat age in ms; 0 turns the check off (hash TTL alone decides liveness)
-- ARGV[4]  optional: the suspect key prefix, `{<prefix>}:suspect:` (suspect key = ARGV[4] .. id)
-- ARGV[5]  optional: the model the session needs; "" (or absent) places on a worker of any model
-- ARGV[6]  optional: the name of the session's prefix (shared/store/prefix_label.py); "" for none
-- ARGV[7..] optional: worker ids the calling gateway suspects itself (it lost its link to them)
--
-- Suspects (docs/failover.md): a gateway whose link to a worker broke sets a short-lived suspect key
-- and skips the worker at once; every gateway's placement skips a worker with a suspect key, so a
-- dead worker is not picked while its hash has yet to expire. A worker that registers afresh
-- deletes its suspect key.
--
-- Prefix (issue #33): among the workers with room, one whose `prefixes` field names the session's
-- prefix is preferred (the least loaded of them): it holds that prefix's KV, so the session maps it
-- instead of computing it. The load rule stays first: only a worker with a free slot is ever picked,
-- and with no such holder the least loaded worker with room is, as without a prefix.
--
-- Returns {id, url}, or nil when no live ready worker has room.
--
-- Liveness is the worker hash itself: it carries a TTL of a few heartbeats, so a worker that stops
-- heartbeating disappears on its own. A ZSET member whose hash is gone is dead and is removed here
-- (ZREM), which is how the ZSET is kept clean without a sweeper. The walk stops at the first pick, so
-- a dead member with a high score lingers until a walk reaches it; it costs nothing meanwhile.
--
-- Load score = sessions / max_sessions (shared/registry.py `load_score`, computed the same way
-- here). The pick is charged at once (sessions + 1, score recomputed from it) so that concurrent
-- opens spread across workers instead of piling onto whichever looked idlest at the last heartbeat;
-- the worker's next heartbeat replaces the charge with its own true count.
--
-- Redis Cluster trade-off: the worker hashes are derived from ARGV[1] instead of being declared in
-- KEYS. Declaring them would need a round trip to read the ZSET first (and a retry when it changed
-- in between). Every key derived here starts with the same `{<prefix>}` hash tag as KEYS[1], so it
-- lives in the same slot and on the same node: Redis/Valkey Cluster runs the script correctly. What
-- is lost is only the declared-keys contract: a proxy that routed by every declared key, or an ACL
-- that whitelists keys by declaration, cannot see these reads. Scripts must never be given a prefix
-- whose tag differs from KEYS[1]'s.

local workers_key = KEYS[1]
local hash_prefix = ARGV[1]
local now_ms = tonumber(ARGV[2])
local max_age_ms = tonumber(ARGV[3]) or 0
local suspect_prefix = ARGV[4]
local model = ARGV[5] or ''
local prefix = ARGV[6] or ''
local excluded = {}
for i = 7, #ARGV do excluded[ARGV[i]] = true end

local function charge(hash_key, id, sessions, max_sessions, url)
  redis.call('HINCRBY', hash_key, 'sessions', 1)
  redis.call('ZADD', workers_key, (sessions + 1) / max_sessions, id)
  return {id, url}
end

local least = nil  -- the least loaded worker with room: {hash_key, id, sessions, max_sessions, url}
local members = redis.call('ZRANGE', workers_key, 0, -1)  -- ascending score: least loaded first
for _, id in ipairs(members) do
  local hash_key = hash_prefix .. id
  local f = redis.call('HMGET', hash_key, 'url', 'state', 'sessions', 'max_sessions', 'heartbeat_ms', 'model', 'prefixes')
  local url = f[1]
  if not url then
    -- The hash expired (or was never complete: registration always writes `url`): a dead member.
    redis.call('ZREM', workers_key, id)
  else
    local sessions = tonumber(f[3]) or 0
    local max_sessions = tonumber(f[4]) or 0
    local heartbeat_ms = tonumber(f[5])
    local fresh = max_age_ms <= 0 or (heartbeat_ms ~= nil and now_ms - heartbeat_ms <= max_age_ms)
    local suspect = excluded[id] or (suspect_prefix and redis.call('EXISTS', suspect_prefix .. id) == 1)
    local serves = model == '' or f[6] == model
    if f[2] == 'ready' and max_sessions > 0 and sessions < max_sessions and fresh and not suspect and serves then
      if prefix == '' then
        return charge(hash_key, id, sessions, max_sessions, url)
      end
      if string.find(' ' .. (f[7] or '') .. ' ', ' ' .. prefix .. ' ', 1, true) then
        return charge(hash_key, id, sessions, max_sessions, url)
      end
      if least == nil then least = {hash_key, id, sessions, max_sessions, url} end
    end
  end
end
if least ~= nil then
  return charge(least[1], least[2], least[3], least[4], least[5])
end
return nil
