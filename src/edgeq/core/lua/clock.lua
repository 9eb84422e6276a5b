-- Shared functions (core/scripts.py prepends this file): Redis's clock, for every script that
-- writes a lease (the renewal and the hand-over in core/leases.py, the worker's claim).
--
-- Expiry = Redis's clock when the renewal lands + the TTL, not the worker's clock when it sent
-- it: a renewal held up in a stalled event loop (seen for 14 s on a 2-core box running two
-- engines) must not arrive already expired and get a live job declared lost. One clock for
-- every lease decision also keeps clock skew between boxes out of it.

-- Redis's clock, Unix ms.
local function redis_now_ms()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
-- When a lease written now for `ttl_ms` (a number, or an ARGV string) runs out, Unix ms.
local function lease_expiry(ttl_ms)
  return redis_now_ms() + tonumber(ttl_ms)
end
