-- Append a flush's records to a session's token log only if the log is what this worker last
-- confirmed it to be (worker/server/token_log.py): its length, and its last bytes. An append is then
-- never written twice (a retried flush whose first try landed finds the log longer, and is refused),
-- and an append after a Redis Cluster failover that lost acknowledged writes finds the log shorter
-- or different, and is refused; the writer then re-writes the whole log (log_rewrite.lua). Checking
-- the last bytes, not a hash of the whole log, keeps an append's cost independent of the log's length.
-- KEYS[1]  the log
-- ARGV[1]  the length this worker confirmed; ARGV[2] the last bytes of the log it confirmed ('' for
--          an empty log); ARGV[3] the new records; ARGV[4] the TTL, ms, of a log this append creates
-- Returns {1, new length} when appended, {0, length} when refused (nothing written).
local expected = tonumber(ARGV[1])
local length = redis.call('STRLEN', KEYS[1])
if length ~= expected then
  return {0, length}
end
if #ARGV[2] > 0 and redis.call('GETRANGE', KEYS[1], expected - #ARGV[2], expected - 1) ~= ARGV[2] then
  return {0, length}
end
local new = redis.call('APPEND', KEYS[1], ARGV[3])
if length == 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {1, new}
