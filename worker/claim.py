"""One claim: a single Lua script takes as many due jobs as the worker has free slots.

It reads the queue's head, sets arq's own in-progress key for each job it takes, writes the
job's lease on Redis's clock (core/leases.py), keeps the payload for as long as the job may run,
counts the start and takes a pending abort, and moves the fair-queuing clocks and aging on
(core/scheduling.py): whichever worker runs it first takes what it can hold, the next one takes
the rest, and no job is taken twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from arq.constants import (
    abort_jobs_ss,
    in_progress_key_prefix,
    job_key_prefix,
    retry_key_prefix,
)
from redis.asyncio import Redis

from edgeq.core.keys import (
    aging_key,
    fair_key,
    leases_key,
    queued_by_tenant_key,
    tenancy_key,
    tenant_of_key,
)
from edgeq.core.leases import lease_expiry_lua
from edgeq.core.scheduling import FAIR_QUEUING_LUA

# Each claim moves up at most this many aged jobs (the rest wait for the next claim, one
# poll later), so a backlog that ages all at once does not make one claim slow.
AGING_BATCH = 64
# arq's run_job keeps a job's start count (its retry key) this long.
START_COUNT_TTL_S = 88_400

# KEYS: the queue, the queue's leases, then its fair-queuing state, tenant-of,
# queued-by-tenant, aging and tenancy keys (core/scheduling.py), then arq's abort set.
# ARGV: now (ms), how many to take, how many of them may be batch jobs, the in-progress TTL
# (ms), the lease TTL (ms), how many of the queue's due jobs to look at, then arq's key
# prefixes for in-progress marks, payloads and start counts, and the start count's TTL (s).
#
# The script reads the queue's head itself, so a poll is one round trip however many
# candidates it looks at (jobs other workers run stay in arq's queue until they finish, so the
# head holds them too). It builds each job's keys from its id with arq's prefixes, which a
# script may do on one Redis, behind Sentinel, and on a Redis Cluster, where job ids carry the
# queue's hash tag so those keys share its slot. Returns, per job taken: id, score, payload
# (false once it expired), start count (arq's job_try, counted here as arq's run_job would)
# and whether an abort was waiting for it.
_CLAIM = (
    lease_expiry_lua("ARGV[5]")
    + FAIR_QUEUING_LUA
    + """
local now, wanted, batch_wanted = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, scan_limit = ARGV[4], tonumber(ARGV[6])
local in_progress_prefix, job_prefix, retry_prefix, retry_ttl = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
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
  local due = redis.call('ZRANGEBYSCORE', aging, '-inf', redis_now, 'LIMIT', 0, AGING_BATCH)
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
""".replace("AGING_BATCH", str(AGING_BATCH))
)

@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job one claim took, with what arq's ``run_job`` would have read in its own round
    trip: the payload (None once its queue deadline passed), its start count, a pending abort."""

    job_id: str
    score: float
    payload: bytes | None
    job_try: int
    aborted: bool


async def claim_due_jobs(
    redis: Redis,
    queue: str,
    *,
    wanted: int,
    wanted_batch: int,
    scan_limit: int,
    ttl_ms: int,
    lease_ttl_ms: int,
    now_ms: int,
    abort_set: str = abort_jobs_ss,
) -> list[ClaimedJob]:
    """In one round trip, take up to ``wanted`` of the first ``scan_limit`` due jobs of the
    queue (score up to ``now_ms``), lowest score first: each one not taken (arq's in-progress
    key is set only if absent, for ``ttl_ms``), at most ``wanted_batch`` of them of the batch
    class. Each one taken is leased for ``lease_ttl_ms`` from Redis's clock, its start counted
    and its payload read as arq's ``run_job`` would; the fair-queuing clocks and aging move on
    (core/scheduling.py). ``abort_set``: where aborts of queued jobs wait (arq's, or the
    queue's own on a cluster)."""
    claim = redis.register_script(_CLAIM)
    claimed = await claim(
        keys=[
            queue,
            leases_key(queue),
            fair_key(queue),
            tenant_of_key(queue),
            queued_by_tenant_key(queue),
            aging_key(queue),
            tenancy_key(queue),
            abort_set,
        ],
        args=[
            now_ms,
            wanted,
            wanted_batch,
            ttl_ms,
            lease_ttl_ms,
            scan_limit,
            in_progress_key_prefix,
            job_key_prefix,
            retry_key_prefix,
            START_COUNT_TTL_S,
        ],
    )
    return [
        ClaimedJob(
            job_id=claimed[i].decode(),
            score=float(claimed[i + 1]),
            payload=claimed[i + 2],
            job_try=int(claimed[i + 3]),
            aborted=bool(claimed[i + 4]),
        )
        for i in range(0, len(claimed), 5)
    ]
