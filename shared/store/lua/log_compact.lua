-- Replace a session's token log with its compacted form and append the flush's new records
-- (worker/server/token_log.py), if the session's record still names this worker. Otherwise only
-- append the new records, as a plain flush does: a worker the gateways gave up on (the session
-- lives on another worker now) must never overwrite the log its successor writes. One slot: both
-- keys carry the session's hash tag.
-- KEYS[1]  the session hash; KEYS[2] its log
-- ARGV[1]  this worker's id; ARGV[2] the TTL, ms, should the log have none
-- ARGV[3]  the compacted log (what this worker's mirror holds, compacted); ARGV[4] the new records
-- Returns {1, length} when the log was compacted, {0, length} when the records were only appended.
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then
  return {0, redis.call('APPEND', KEYS[2], ARGV[4])}
end
local ttl = redis.call('PTTL', KEYS[2])
if ttl <= 0 then ttl = ARGV[2] end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ttl)
return {1, redis.call('APPEND', KEYS[2], ARGV[4])}
