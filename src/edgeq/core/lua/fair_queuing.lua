-- Shared functions (core/scripts.py prepends this file) of the enqueue and cancel
-- (producer/queue.py) and the claim (worker/claim.py): priority bands and fair queuing
-- (core/scheduling.py).
--
-- A queued job's entry in tenant-of is "<band it was enqueued in>:<tenant>": the tenant for the
-- counts and flows, and whether it was born batch (it keeps off the reserved slots after
-- aging has moved it up). Each flow (band, tenant) counts its queued jobs; a flow with none
-- starts its next job at the band's clock, whatever its old tag (a tenant that cancelled its
-- backlog, or had it all claimed, owes nothing), and its fields are dropped, so the hash holds
-- only the flows with work queued. Scores and tags are written with %.17g: Lua's own
-- number-to-string keeps only 14 digits, which would merge a weight-3 tenant's tags in the
-- batch band.

-- Width of one band of scores: core/scheduling.py's BAND_SPAN (tests/test_lua.py checks that
-- they agree).
local BAND_SPAN = 500000000000
local function exact(number) return string.format('%.17g', number) end
local function band_of_score(score) return math.min(math.floor(score / BAND_SPAN), 2) end
local function score_of(band, start) return exact(band * BAND_SPAN + start) end
-- A tenant's weight: its own, else the queue's default, else 1.
local function weight_from(own, default) return tonumber(own or default or '1') end
local function weight_of(tenancy, tenant)
  local weights = redis.call('HMGET', tenancy, 'weight:' .. tenant, 'default_weight')
  return weight_from(weights[1], weights[2])
end
-- The start tag of the tenant's next job in the band; the job joins the tenant's flow there.
local function join_flow(fair, band, tenant, weight)
  local flow = band .. ':' .. tenant
  local state = redis.call('HMGET', fair, 'clock:' .. band, 'tag:' .. flow, 'queued:' .. flow)
  local start = tonumber(state[1] or '0')
  if tonumber(state[3] or '0') > 0 then start = math.max(start, tonumber(state[2])) end
  redis.call('HSET', fair, 'tag:' .. flow, exact(start + 1 / weight))
  redis.call('HINCRBY', fair, 'queued:' .. flow, 1)
  return start
end
local function leave_flow(fair, band, tenant)
  local flow = band .. ':' .. tenant
  if redis.call('HINCRBY', fair, 'queued:' .. flow, -1) <= 0 then
    redis.call('HDEL', fair, 'tag:' .. flow, 'queued:' .. flow)
  end
end
-- A queued job's tenant and the band it was enqueued in; nil if it is not queued (claimed,
-- cancelled, or enqueued without edgeq's script).
local function queued_entry(tenant_of, job_id)
  local entry = redis.call('HGET', tenant_of, job_id)
  if not entry then return nil end
  local born, tenant = string.match(entry, '^(%d):(.*)$')
  return tenant, tonumber(born)
end
-- Take a queued job out of every count (it was claimed or cancelled) while it is in `band`.
local function dequeued(fair, tenant_of, queued, aging, job_id, band, tenant)
  redis.call('HDEL', tenant_of, job_id)
  redis.call('HINCRBY', queued, tenant, -1)
  leave_flow(fair, band, tenant)
  redis.call('ZREM', aging, job_id)
end
