-- Re-write a session a worker holds whose keys lost writes (a Redis Cluster failover: writes the
-- dead master acknowledged and never replicated), unless the record now names another worker (the
-- session moved: its new worker owns it). One slot: both keys carry the session's hash tag.
-- KEYS[1]  the session hash; KEYS[2] its log
-- ARGV[1]  this worker's id; ARGV[2] the TTL, ms; ARGV[3] the whole log ('' when none yet)
-- ARGV[4..] the record's fields and values
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner and owner ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if #ARGV[3] > 0 then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
end
return 1
