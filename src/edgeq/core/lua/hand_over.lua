-- Take a run-out lease and make its job claimable again, or say why it cannot be
-- (core/leases.py hand_over; needs clock.lua).
--
-- A lease can only run out while Redis is up: nobody can renew one while Redis is away, and
-- Redis's clock goes on meanwhile. So until Redis has been up for one lease TTL (whole seconds
-- of INFO's uptime, rounded down: never early), no lease counts as run out; a live worker
-- renews its leases within a quarter TTL of Redis coming back, however long Redis was away.
--
-- A job that was running at POISON_AFTER_ENGINE_FAILURES (core/leases.py) engine failures
-- (deaths or stalls, counted by the failing workers before they exit) is not made claimable
-- again: its payload goes to the queue's dead-letter set, in the same step, and the caller
-- ends it with `poison_job`.
--
-- KEYS: the queue's leases, the queue, the job's in-progress, payload, terminal and start-count
-- keys, its engine-failure count, the queue's dead-letter set and the job's dead-letter entry;
-- ARGV: job id, continuations allowed, how long the payload waits for a taker (ms), the
-- queue's wake channel, the lease TTL (ms), the engine failures that quarantine a job, how long
-- a dead-letter entry is kept (ms). Returns a Handover.
local now = redis_now_ms()
local leased_until = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not leased_until or tonumber(leased_until) >= now then return 0 end
local up_s = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)'))
if up_s * 1000 < tonumber(ARGV[5]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 1 then
  -- The stream has ended (cancelled while its worker was gone, or the worker sent its terminal
  -- event and died before finishing arq's records): nothing to hand over, and nobody left to
  -- finish the records, so they are finished here, as a worker's end would (its in-progress
  -- mark would otherwise stay for the claim's whole TTL, and the job stay in the queue).
  redis.call('DEL', KEYS[3], KEYS[4])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
local failures = tonumber(redis.call('GET', KEYS[7]) or '0')
if failures >= tonumber(ARGV[6]) and redis.call('EXISTS', KEYS[4]) == 1 then
  local kept_ms = tonumber(ARGV[7])
  redis.call('HSET', KEYS[9], 'payload', redis.call('GET', KEYS[4]), 'failures', failures,
    'at', now)
  redis.call('PEXPIRE', KEYS[9], kept_ms)
  redis.call('ZREMRANGEBYSCORE', KEYS[8], '-inf', now - kept_ms)
  redis.call('ZADD', KEYS[8], now, ARGV[1])
  return 4
end
if tonumber(redis.call('GET', KEYS[6]) or '1') > tonumber(ARGV[2]) then return 2 end
if redis.call('EXISTS', KEYS[4]) == 0 or not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 3
end
redis.call('DEL', KEYS[3])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('PUBLISH', ARGV[4], '')
return 1
