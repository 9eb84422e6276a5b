-- Enqueue one chat job (producer/queue.py JobQueue.enqueue; needs clock.lua, fair_queuing.lua
-- and limits.lua). Runs in a BatchedScript only (core/batching.py): it keeps what a batch's
-- calls share in `batch`, and wakes the workers once per batch.
--
-- KEYS: the queue, the job's payload, then the queue's fair-queuing state, tenant-of,
-- queued-by-tenant, aging and tenancy keys (core/scheduling.py), optionally the queue's batch
-- lines (core/keys.py batch_lines_key), optionally (after the batch lines) the submit's
-- idempotency key (core/keys.py idempotency_key), and optionally (after that) the tenant's
-- limits usage hash and the job's reservation key (core/keys.py limits_usage_key,
-- reservation_key); ARGV: the payload, its TTL (ms), the queue's limit, the job id, the wake
-- channel, the band, the tenant, with the idempotency key the request's hash and how long the
-- key holds (ms), and with the limits keys the prompt's estimated tokens and the completion
-- tokens to reserve (0: the workers' EDGEQ_MAX_TOKENS), and optionally (after the limits keys)
-- the request's poison-refusal key (core/keys.py poison_refusal_key, named by its fingerprint:
-- core/fingerprint.py; a call that has no fingerprint and passes what follows passes the
-- refusal key of the empty fingerprint, which is never set), and optionally (after that) the
-- usage hash of the API key the request came with (core/keys.py key_limits_usage_key) with
-- ARGV 12 the key's name ('': none). A call with the limits keys and no idempotency key passes
-- any key of the queue's slot (the payload's) as the idempotency key and an empty hash.
-- Returns {Enqueued, the tenant's cap when it is TENANT_FULL, or the job id the idempotency
-- key was given when it is EXISTING or IDEMPOTENCY_CONFLICT, or what limits.lua's admit says
-- when it is RATE_LIMITED}; UNLIMITED_CALLER ({-5}) for a call without the limits keys for a
-- tenant that has limits; POISON_REFUSED ({-6, the quarantined job's id, the ms the refusal
-- still holds}) while the poison-refusal key is set.
--
-- The idempotency key is looked at first, so a retried submit gets its job's id even when the
-- queue has filled up since; it is taken only with the enqueue. Calls of one batch run one
-- after the other in this script, so 50 submits with one key enqueue one job.
--
-- A request the same as a quarantined one (a poison job: core/leases.py) is refused next,
-- before anything is counted: sending it again would take down engines again, and waiting
-- for room in the queue would not change that.
--
-- The lines of batches (resources/batches/runner.py) are bounded on their own
-- (EDGEQ_GATEWAY_BATCH_QUEUED_MAX; their runner enqueues them with no limit) and left out of
-- the depth every other job is admitted against, so batches never get a chat refused.

-- What the calls of one batch read alike is read once per batch: each redis.call costs a
-- script ~3 us (Redis's SLOWLOG on a 2-vCPU machine, 2026-12-05: a burst's enqueue of 50 jobs,
-- ~13 calls a job, took 1.6-1.8 ms). The queue's depth is counted on from there.
local function per_batch(key, read)
  if batch[key] == nil then batch[key] = read() end
  return batch[key]
end
local limit, band, tenant = tonumber(ARGV[3]), tonumber(ARGV[6]), ARGV[7]
local idempotent = KEYS[9] ~= nil and (ARGV[8] or '') ~= ''
if idempotent then
  local held = redis.call('GET', KEYS[9])
  if held then
    local space = string.find(held, ' ', 1, true)
    local held_id = string.sub(held, 1, space - 1)
    if string.sub(held, space + 1) == ARGV[8] then return {2, held_id} end
    return {-3, held_id}
  end
end
if KEYS[12] then
  local quarantined = redis.call('GET', KEYS[12])
  if quarantined then return {-6, quarantined, redis.call('PTTL', KEYS[12])} end
end
local depth_key = 'depth:' .. KEYS[1]
local function depth() return redis.call('ZCARD', KEYS[1]) end
if limit > 0 then
  local counted = per_batch(depth_key, depth)
  if KEYS[8] then
    counted = counted - per_batch('lines:' .. KEYS[8], function()
      return redis.call('SCARD', KEYS[8])
    end)
  end
  if counted >= limit then return {0} end
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {-1} end
local rules = per_batch('tenant:' .. KEYS[7] .. ':' .. tenant, function()
  return redis.call('HMGET', KEYS[7], 'max_queued:' .. tenant, 'weight:' .. tenant,
    'default_weight', 'aging_ms', 'rpm:' .. tenant, 'tpm:' .. tenant, 'tpd:' .. tenant,
    'tpmo:' .. tenant, 'limits_clock_ms', 'max_tokens')
end)
local cap = tonumber(rules[1] or '0')
if cap > 0 then
  local queued = tonumber(redis.call('HGET', KEYS[5], tenant) or '0')
  -- Nor does the tenant's own batch work get its chats refused: an interactive or default
  -- job counts the tenant's jobs queued in those classes only (a batch job, all of them).
  if band < 2 then
    queued = queued - tonumber(redis.call('HGET', KEYS[3], 'queued:2:' .. tenant) or '0')
  end
  if queued >= cap then return {-2, cap} end
end
-- Rate limits and token budgets last: a chat refused for any other reason counts nowhere.
local limits = {rules[5], rules[6], rules[7], rules[8]}
if KEYS[10] then
  local completion = tonumber(ARGV[11])
  if completion <= 0 then completion = tonumber(rules[10] or '256') end
  local scopes = {{used = KEYS[10], limits = limits, who = 'tenant', counted = tenant}}
  local key_name = ARGV[12] or ''
  if KEYS[13] and key_name ~= '' then
    local key_limits = per_batch('key:' .. KEYS[7] .. ':' .. key_name, function()
      return redis.call('HMGET', KEYS[7], 'krpm:' .. key_name, 'ktpm:' .. key_name,
        'ktpd:' .. key_name, 'ktpmo:' .. key_name)
    end)
    scopes[2] = {used = KEYS[13], limits = key_limits, who = 'key', counted = 'key:' .. key_name}
  end
  -- Held while the chat may still run: its deadline in the queue, and an hour to answer.
  local refused = admit(scopes, KEYS[11], tenant, tonumber(ARGV[10]), completion,
    tonumber(ARGV[2]) + 3600000, rules[9])
  if refused then return refused end
elseif limited(limits) then
  return {-5}
end
local start = join_flow(KEYS[3], band, tenant, weight_from(rules[2], rules[3]))
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[1], score_of(band, start), ARGV[4])
redis.call('HSET', KEYS[4], ARGV[4], band .. ':' .. tenant)
redis.call('HINCRBY', KEYS[5], tenant, 1)
if idempotent then redis.call('SET', KEYS[9], ARGV[4] .. ' ' .. ARGV[8], 'PX', ARGV[9]) end
if batch[depth_key] then batch[depth_key] = batch[depth_key] + 1 end
local aging_ms = tonumber(rules[4] or '0')
if band > 0 and aging_ms > 0 then
  local clock = redis.call('TIME')
  local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  redis.call('ZADD', KEYS[6], now_ms + aging_ms, ARGV[4])
end
-- One wake per batch (core/batching.py) is enough: the claim it starts takes them all.
if not batch[ARGV[5]] then
  redis.call('PUBLISH', ARGV[5], '')
  batch[ARGV[5]] = true
end
return {1}
