-- Take a job out of the queue, and out of its tenant's counts and flow if it was still
-- queued (producer/queue.py cancel; needs fair_queuing.lua).
-- KEYS: the queue, the payload, then the fair, tenant-of, queued-by-tenant, aging and tenancy
-- keys; ARGV: the job id. Returns {the payload (false: gone), the workers' model, their
-- ledger lifetime (s)}: what the cancel's terminal event is counted under in the usage ledger
-- (core/ledger.py unanswered_scope), read in this step before the payload goes.
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or nil)
local tenant = queued_entry(KEYS[4], ARGV[1])
if score and tenant then
  dequeued(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], band_of_score(score), tenant)
end
local payload = redis.call('GET', KEYS[2])
local ledger = redis.call('HMGET', KEYS[7], 'model', 'usage_keep_s')
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return {payload, ledger[1], ledger[2]}
