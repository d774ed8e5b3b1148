-- key_admit.lua (after now_ms.lua): admit one session under its API key's concurrent-session limit.
--
-- KEYS[1]  the key's lease ZSET (sid -> lease end, ms)
-- ARGV[1]  sid; ARGV[2] max sessions (0: none); ARGV[3] lease, ms
-- Returns 1 admitted, 0 full. A session already a member (a resume, or a second socket of this
-- gateway) is renewed, never refused.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  local max = tonumber(ARGV[2])
  if max > 0 and redis.call('ZCARD', KEYS[1]) >= max then return 0 end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
