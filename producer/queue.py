"""Putting jobs into arq's queue and taking them out again, atomically.

The enqueue is one Lua script instead of arq's WATCH/MULTI, because the depth check and the
enqueue must be one step: a burst of producers can never push the queue past its limit.
The job is stored exactly as arq expects it (README, "Wire contract").
"""

from __future__ import annotations

import asyncio
import time
from enum import IntEnum
from typing import Any, NamedTuple

from redis.asyncio import Redis

from edgeq.core.batching import BatchedScript
from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import (
    aging_key,
    fair_key,
    job_key,
    queued_by_tenant_key,
    tenancy_key,
    tenant_of_key,
    wake_channel,
)
from edgeq.core.protocol import JOB_FUNCTION, ErrorEvent, dump_json
from edgeq.core.scheduling import FAIR_QUEUING_LUA, Priority, band_of

# KEYS: the queue, the job's payload, then the queue's fair-queuing state, tenant-of,
# queued-by-tenant, aging and tenancy keys (core/scheduling.py); ARGV: the payload, its TTL
# (ms), the queue's limit, the job id, the wake channel, the band, the tenant. Returns
# {Enqueued, the tenant's cap when it is TENANT_FULL}. Runs in a BatchedScript only (it wakes
# the workers once per batch).
_ENQUEUE = (
    FAIR_QUEUING_LUA
    + """
-- What the calls of one batch read alike is read once per batch: each redis.call costs a
-- script ~3 us (docs/benchmarks.md). The queue's depth is counted on from there.
local function per_batch(key, read)
  if batch[key] == nil then batch[key] = read() end
  return batch[key]
end
local limit = tonumber(ARGV[3])
local depth_key = 'depth:' .. KEYS[1]
local function depth() return redis.call('ZCARD', KEYS[1]) end
if limit > 0 and per_batch(depth_key, depth) >= limit then return {0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {-1} end
local band, tenant = tonumber(ARGV[6]), ARGV[7]
local rules = per_batch('tenant:' .. KEYS[7] .. ':' .. tenant, function()
  return redis.call('HMGET', KEYS[7], 'max_queued:' .. tenant, 'weight:' .. tenant,
    'default_weight', 'aging_ms')
end)
local cap = tonumber(rules[1] or '0')
if cap > 0 and tonumber(redis.call('HGET', KEYS[5], tenant) or '0') >= cap then
  return {-2, cap}
end
local start = join_flow(KEYS[3], band, tenant, weight_from(rules[2], rules[3]))
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[1], score_of(band, start), ARGV[4])
redis.call('HSET', KEYS[4], ARGV[4], band .. ':' .. tenant)
redis.call('HINCRBY', KEYS[5], tenant, 1)
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
"""
)

# Take a job out of the queue, and out of its tenant's counts and flow if it was still
# queued. KEYS: the queue, the payload, then the fair, tenant-of, queued-by-tenant and aging
# keys; ARGV: the job id.
_DEQUEUE = (
    FAIR_QUEUING_LUA
    + """
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or nil)
local tenant = queued_entry(KEYS[4], ARGV[1])
if score and tenant then
  dequeued(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], band_of_score(score), tenant)
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
"""
)


class Enqueued(IntEnum):
    ACCEPTED = 1
    QUEUE_FULL = 0
    DUPLICATE_ID = -1
    TENANT_FULL = -2


class EnqueueOutcome(NamedTuple):
    outcome: Enqueued
    tenant_cap: int = 0  # the tenant's EDGEQ_TENANT_MAX_QUEUED, for TENANT_FULL


class JobQueue:
    def __init__(self, redis: Redis, queue: str) -> None:
        self.name = queue
        self._redis = redis
        # Submits from many coroutines share one script call per loop turn (core/batching.py).
        self._enqueue = BatchedScript(redis, _ENQUEUE)
        self._dequeue = redis.register_script(_DEQUEUE)
        self._scheduling_keys = [
            fair_key(queue),
            tenant_of_key(queue),
            queued_by_tenant_key(queue),
            aging_key(queue),
            tenancy_key(queue),
        ]

    async def enqueue(
        self,
        job_id: str,
        request: dict[str, Any],
        *,
        deadline_s: float,
        max_depth: int,
        tenant: str,
        priority: Priority | None,
        after: asyncio.Future[Any] | None = None,
    ) -> EnqueueOutcome:
        """Add a chat job unless the queue already holds ``max_depth`` jobs (0: no limit) or
        the tenant has as many queued as its cap; its score puts it in its priority class and
        its tenant's fair share (core/scheduling.py).

        The job's payload expires after ``deadline_s``: a worker reaching it later finds it
        gone and ends it with ``expired`` instead of starting it late. ``after``: a future the
        enqueue is not sent before, and not at all if it fails (core/batching.py).
        """
        now_ms = time.time() * 1000
        # `et` to the microsecond, so queued_ms can show sub-millisecond pickup.
        job = {"f": JOB_FUNCTION, "a": [request], "k": {}, "t": 1, "et": round(now_ms, 3)}
        reply = await self._enqueue(
            [self.name, job_key(job_id), *self._scheduling_keys],
            [
                dump_json(job),
                int(deadline_s * 1000),
                max_depth,
                job_id,
                wake_channel(self.name),
                band_of(priority),
                tenant,
            ],
            after=after,
        )
        return EnqueueOutcome(Enqueued(int(reply[0])), *(int(value) for value in reply[1:]))

    async def depth(self) -> int:
        """Jobs accepted and not finished (arq keeps running jobs in the queue too)."""
        return int(await self._redis.zcard(self.name))

    async def cancel(self, log: EventLog, job_id: str, reason: str) -> bool:
        """End a job with ``cancelled``. A queued job never starts; a running one stops at
        its next event (its worker finds the stream closed and aborts the engine request).
        False if the job had already ended.

        The job leaves the queue before its stream ends, so whoever sees ``cancelled`` finds
        its place in the queue free (a job that had ended is gone from the queue anyway)."""
        await self._dequeue(
            keys=[self.name, job_key(job_id), *self._scheduling_keys[:4]], args=[job_id]
        )
        try:
            await log.append(ErrorEvent(job_id=job_id, seq=0, code="cancelled", message=reason))
        except StreamClosed:
            return False
        return True
