-- mark_draining.lua: set a worker hash's `state` only while the hash lives (shared/registry.py).
-- A plain HSET on an expired worker would recreate its hash with no TTL, an immortal ghost the
-- placement script would keep seeing as live.
--
-- KEYS[1]  the worker hash; ARGV[1] the state field, ARGV[2] its new value
-- Returns 1 when set, 0 when the worker's hash no longer exists.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
