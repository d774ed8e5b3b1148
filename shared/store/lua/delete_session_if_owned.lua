-- delete_session_if_owned.lua: delete a session record that names this worker, or that names none
-- (worker/server/token_log.py). A session this worker lost track of may live on another worker by
-- now, restored under the same id: then nothing is deleted.
--
-- KEYS[1]  the session hash; ARGV[1] this worker's id
-- Returns 1 when deleted (the log may go too: it lives in another slot, deleted after), else 0.
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner == false or owner == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
