-- Re-write a session's whole token log after log_append.lua refused a flush (the log in Redis is not
-- what this worker confirmed: a failover lost writes, or an earlier flush's records landed though
-- its reply was lost), if the session's record names this worker or is gone (the heartbeat re-writes
-- a lost record: shared/store/held.py). A log whose session moved to another worker is never
-- touched. One slot: both keys carry the session's hash tag.
-- KEYS[1]  the session hash; KEYS[2] its log
-- ARGV[1]  this worker's id; ARGV[2] the TTL, ms, should the log have none; ARGV[3] the whole log
-- Returns {1, length} when re-written, {0, length} when the session is another worker's.
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner and owner ~= ARGV[1] then
  return {0, redis.call('STRLEN', KEYS[2])}
end
local ttl = redis.call('PTTL', KEYS[2])
if ttl <= 0 then ttl = ARGV[2] end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ttl)
return {1, redis.call('STRLEN', KEYS[2])}
