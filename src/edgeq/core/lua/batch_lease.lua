-- Take or keep a batch's lease (resources/batches/runner.py): one runner at a time runs a batch;
-- a runner that stops renewing (its gateway was killed) loses it after the TTL, and another
-- takes it over.
--
-- KEYS: the lease; ARGV: the runner's token, the TTL (ms). Returns 1 if the runner holds the
-- lease now (taken or renewed), 0 if another runner holds it.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
