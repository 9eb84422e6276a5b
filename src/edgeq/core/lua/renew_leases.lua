-- A worker's promise that its jobs are alive for a TTL from now, on Redis's clock
-- (core/leases.py renew_leases; needs clock.lua).
-- KEYS: the queue's leases; ARGV: the lease TTL (ms), then the job ids.
local expiry = lease_expiry(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], expiry, ARGV[i])
end
