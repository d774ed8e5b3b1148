-- unclaim_token.lua: give a browser token back when the session it was claimed for never opened
-- (no worker had room). Only the claimant may, and the token gets its original start window back
-- (gone if it is over).
--
-- KEYS[1]  the token's hash
-- ARGV[1]  the session id that claimed it; ARGV[2] the token's original expiry, ms since the epoch
if redis.call('HGET', KEYS[1], 'sid') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'sid')
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return 1
