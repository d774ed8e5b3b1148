-- key_renew.lua (after now_ms.lua): renew this gateway's leases of one API key, in one call a second.
--
-- KEYS[1]  the key's lease ZSET; ARGV[1] lease, ms; ARGV[2..] the sids
-- Re-adds a member that lapsed (this gateway stalled past the lease): the session is live, so it
-- counts. Returns how many sids were renewed.
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], lease)
return #ARGV - 1
