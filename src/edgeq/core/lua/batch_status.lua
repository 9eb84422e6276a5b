-- Move a batch to a new status (resources/batches/store.py): only from one of the statuses given,
-- so a cancel and a runner finishing the batch can never both win.
--
-- KEYS: the batch's record (a hash); ARGV: the new status, the timestamp field to set with
-- it ('' for none), now (Unix s), then every status it may move from. Returns {1, the new
-- status} when moved, else {0, the status it has}.
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {0, ''} end
for index = 4, #ARGV do
  if ARGV[index] == current then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    if ARGV[2] ~= '' then redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3]) end
    return {1, ARGV[1]}
  end
end
return {0, current}
