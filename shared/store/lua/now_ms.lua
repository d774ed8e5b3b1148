-- now_ms.lua: a prelude, not a script of its own. `now` is Redis's own clock in ms, so leases
-- written by every gateway compare on one clock (gateway/key_ledger.py).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
