-- claim_token.lua: bind a browser token to the session it opens (gateway/auth/client_tokens.py).
--
-- KEYS[1]  the token's hash
-- ARGV[1]  the session id; ARGV[2] how long the claim holds, ms
-- Returns 1 when the token now belongs to ARGV[1] (claimed now or before by the same session), 0
-- when it is gone or belongs to another session. EXISTS first: HSET on an expired token would
-- recreate it as a hash without a TTL.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local owner = redis.call('HGET', KEYS[1], 'sid')
if owner then
  if owner == ARGV[1] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'sid', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
