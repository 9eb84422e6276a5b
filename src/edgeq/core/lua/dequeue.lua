-- Take a job out of the queue, and out of its tenant's counts and flow if it was still
-- queued (producer/queue.py; needs fair_queuing.lua).
-- KEYS: the queue, the payload, then the fair, tenant-of, queued-by-tenant and aging keys;
-- ARGV: the job id.
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or nil)
local tenant = queued_entry(KEYS[4], ARGV[1])
if score and tenant then
  dequeued(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], band_of_score(score), tenant)
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
