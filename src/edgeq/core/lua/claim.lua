-- One claim: take as many due jobs as the worker has free slots (worker/claim.py
-- claim_due_jobs; needs clock.lua and fair_queuing.lua).
--
-- KEYS: the queue, the queue's leases, then its fair-queuing state, tenant-of,
-- queued-by-tenant, aging and tenancy keys (core/scheduling.py), then arq's abort set.
-- ARGV: now (ms), how many to take, how many of them may be batch jobs, the in-progress TTL
-- (ms), the lease TTL (ms), how many of the queue's due jobs to look at, then arq's key
-- prefixes for in-progress marks, payloads and start counts, the start count's TTL (s), and
-- how many aged jobs to move up at most.
--
-- The script reads the queue's head itself, so a poll is one round trip however many
-- candidates it looks at (jobs other workers run stay in arq's queue until they finish, so the
-- head holds them too). It builds each job's keys from its id with arq's prefixes, which a
-- script may do on one Redis, behind Sentinel, and on a Redis Cluster, where job ids carry the
-- queue's hash tag so those keys share its slot. Returns, per job taken: id, score, payload
-- (false once it expired), start count (arq's job_try, counted here as arq's run_job would)
-- and whether an abort was waiting for it.
local expiry = lease_expiry(ARGV[5])
local now, wanted, batch_wanted = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, scan_limit = ARGV[4], tonumber(ARGV[6])
local in_progress_prefix, job_prefix, retry_prefix, retry_ttl = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local aging_batch = tonumber(ARGV[11])
local queue, leases, fair, tenant_of, queued, aging, tenancy, abort = unpack(KEYS, 1, 8)
local head = redis.call('ZRANGEBYSCORE', queue, '-inf', now, 'WITHSCORES', 'LIMIT', 0, scan_limit)
local claimed, taken, batch = {}, 0, 0
local clocks = {}  -- per band, the largest start tag taken: written once, after the loop
for i = 1, #head, 2 do
  if taken >= wanted then break end
  local job_id, score = head[i], tonumber(head[i + 1])
  local band = band_of_score(score)
  local tenant, born = queued_entry(tenant_of, job_id)
  -- Batch work keeps off the reserved slots, also once aging has moved it up.
  local is_batch = (born or band) == 2
  if (not is_batch or batch < batch_wanted)
      and redis.call('SET', in_progress_prefix .. job_id, '1', 'NX', 'PX', ttl) then
    if is_batch then batch = batch + 1 end
    taken = taken + 1
    redis.call('ZADD', leases, expiry, job_id)
    local payload_key = job_prefix .. job_id
    redis.call('PEXPIRE', payload_key, ttl)
    local starts = redis.call('INCR', retry_prefix .. job_id)
    redis.call('EXPIRE', retry_prefix .. job_id, retry_ttl)
    local tag = score - band * BAND_SPAN
    if tag > (clocks[band] or -1) then clocks[band] = tag end
    if tenant then dequeued(fair, tenant_of, queued, aging, job_id, band, tenant) end
    claimed[#claimed + 1] = job_id
    claimed[#claimed + 1] = exact(score)
    claimed[#claimed + 1] = redis.call('GET', payload_key)
    claimed[#claimed + 1] = starts
    claimed[#claimed + 1] = redis.call('ZREM', abort, job_id)
    -- Where it was queued, for a job whose payload expired: its end is counted there in the
    -- usage ledger (core/ledger.py queued_scope), the payload being gone.
    claimed[#claimed + 1] = tenant and (born .. ':' .. tenant) or false
  end
end
-- Each band's virtual clock: the largest start tag taken in it.
for band, tag in pairs(clocks) do
  if tag > tonumber(redis.call('HGET', fair, 'clock:' .. band) or '0') then
    redis.call('HSET', fair, 'clock:' .. band, exact(tag))
  end
end
-- Aging: jobs queued long enough move up one class, into their tenant's flow there.
local aging_ms = tonumber(redis.call('HGET', tenancy, 'aging_ms') or '0')
if aging_ms > 0 then
  local redis_now = expiry - tonumber(ARGV[5])
  local due = redis.call('ZRANGEBYSCORE', aging, '-inf', redis_now, 'LIMIT', 0, aging_batch)
  for _, job_id in ipairs(due) do
    local score = tonumber(redis.call('ZSCORE', queue, job_id) or nil)
    local tenant = queued_entry(tenant_of, job_id)
    local band = score and band_of_score(score)
    if tenant and band and band > 0 then
      leave_flow(fair, band, tenant)
      band = band - 1
      local start = join_flow(fair, band, tenant, weight_of(tenancy, tenant))
      redis.call('ZADD', queue, 'XX', score_of(band, start), job_id)
      if band > 0 then
        redis.call('ZADD', aging, redis_now + aging_ms, job_id)
      else
        redis.call('ZREM', aging, job_id)
      end
    else
      redis.call('ZREM', aging, job_id)  -- claimed, cancelled, or already interactive
    end
  end
end
return claimed
