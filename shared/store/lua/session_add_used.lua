-- session_add_used.lua: add to a budgeted session's spent tokens (shared/store/registry.py `SessionUsage`).
--
-- KEYS[1]  the session hash; ARGV[1] the field, ARGV[2] the tokens to add
-- Only touched while the hash exists (HINCRBY alone would recreate it, TTL-less): -1 when gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
