"""Fast job pickup for arq: a wake-up instead of blind polling, and one round trip to take a
whole burst.

arq finds jobs by polling its queue every ``poll_delay`` (500 ms by default: ~250 ms added to
every chat) and takes them one at a time: per job a WATCH/EXISTS/ZSCORE/MULTI transaction of
~4 Redis round trips. A burst of 64 chats then reaches the
engine over 256 round trips, each one queued behind the streaming of the chats already
running; and with several workers on one queue all of them walk the same ids in the same
order, so the slower one loses every race and sits idle while jobs wait. Here:

- producers PUBLISH on ``{queue}:wake`` after each enqueue (producer/queue.py); an idle worker
  waits on that channel, so a job starts within a Redis round trip of its enqueue, and an idle
  worker still looks once per ``IDLE_WAIT_S`` in case a producer did not signal;
- while jobs run, the worker polls every ``poll_delay`` (slots free up, aborts arrive);
- ``start_jobs`` takes as many due jobs as it has free slots in one Lua script
  (``claim_due_jobs``), setting arq's own in-progress key as arq would: whichever worker runs
  it first takes what it can hold, the next one takes the rest, and no job is taken twice.
  The same step writes each job's lease (on Redis's clock, core/leases.py), so a job is never
  taken without one: a worker that dies, or loses Redis, right after its claim still leaves
  jobs that anyone can hand over; and it keeps the job's payload for as long as the job may
  run (its queue deadline no longer applies once it started), so a worker continuing the job
  after a crash still finds the request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.connections import log_redis_info
from arq.utils import timestamp_ms
from arq.worker import Worker
from redis.asyncio import Redis

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.keys import (
    aging_key,
    fair_key,
    in_progress_key,
    job_key,
    leases_key,
    queued_by_tenant_key,
    tenancy_key,
    tenant_of_key,
    wake_channel,
)
from edgeq.core.leases import lease_expiry_lua
from edgeq.core.scheduling import FAIR_QUEUING_LUA

# An idle worker also looks at the queue this often, for producers that do not signal.
IDLE_WAIT_S = 1.0
# After a Redis error while waiting, pause this long before trying again.
WAIT_RETRY_S = 0.5
# Each claim moves up at most this many aged jobs (the rest wait for the next claim, one
# poll later), so a backlog that ages all at once does not make one claim slow.
AGING_BATCH = 64

# KEYS: the queue, the queue's leases, then its fair-queuing state, tenant-of,
# queued-by-tenant, aging and tenancy keys (core/scheduling.py), then arq's in-progress key of
# each candidate, then each candidate's payload key; ARGV: now (ms), how many to take, how many
# of them may be batch jobs, the in-progress TTL (ms), the lease TTL (ms), then the candidates'
# ids. Returns id, score, id, score, ...
_CLAIM = (
    lease_expiry_lua("ARGV[5]")
    + FAIR_QUEUING_LUA
    + """
local now, wanted, batch_wanted = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl = ARGV[4]
local queue, leases, fair, tenant_of, queued, aging, tenancy = unpack(KEYS, 1, 7)
local candidates = (#KEYS - 7) / 2
local claimed, batch = {}, 0
for i = 1, candidates do
  if #claimed >= 2 * wanted then break end
  local job_id = ARGV[i + 5]
  local score = tonumber(redis.call('ZSCORE', queue, job_id) or nil)
  local band = score and band_of_score(score)
  local tenant, born = queued_entry(tenant_of, job_id)
  -- Batch work keeps off the reserved slots, also once aging has moved it up.
  local is_batch = (born or band) == 2
  if score and score <= now and (not is_batch or batch < batch_wanted)
      and redis.call('SET', KEYS[7 + i], '1', 'NX', 'PX', ttl) then
    if is_batch then batch = batch + 1 end
    redis.call('ZADD', leases, expiry, job_id)
    redis.call('PEXPIRE', KEYS[7 + candidates + i], ttl)
    -- The band's virtual clock: the largest start tag taken in it.
    local tag = score - band * BAND_SPAN
    if tag > tonumber(redis.call('HGET', fair, 'clock:' .. band) or '0') then
      redis.call('HSET', fair, 'clock:' .. band, exact(tag))
    end
    if tenant then dequeued(fair, tenant_of, queued, aging, job_id, band, tenant) end
    claimed[#claimed + 1] = job_id
    claimed[#claimed + 1] = exact(score)
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
      local start = join_flow(fair, tenancy, band, tenant)
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

arq_logger = logging.getLogger("arq.worker")


async def claim_due_jobs(
    redis: Redis,
    queue: str,
    job_ids: list[str],
    *,
    wanted: int,
    wanted_batch: int,
    ttl_ms: int,
    lease_ttl_ms: int,
    now_ms: int,
) -> list[tuple[str, float]]:
    """Take up to ``wanted`` of ``job_ids``, in their order, in one round trip: each one that is
    due (in the queue with a score up to ``now_ms``: not deferred, not finished) and not taken
    (arq's in-progress key is set only if absent, for ``ttl_ms``), at most
    ``wanted_batch`` of them of the batch class; lease each one taken
    for ``lease_ttl_ms`` from Redis's clock, and move the fair-queuing clocks and aging on
    (core/scheduling.py). Returns (id, score) pairs."""
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
            *(in_progress_key(job_id) for job_id in job_ids),
            *(job_key(job_id) for job_id in job_ids),
        ],
        args=[now_ms, wanted, wanted_batch, ttl_ms, lease_ttl_ms, *job_ids],
    )
    return [
        (raw_id.decode(), float(raw_score))
        for raw_id, raw_score in zip(claimed[::2], claimed[1::2], strict=True)
    ]


class FastPickupWorker(Worker):
    """arq's Worker with a wake-up channel and one round trip per claim (see the module doc)."""

    _wake: Any = None

    #: How long the lease written at claim lasts (EDGEQ_LEASE_TTL_S), in ms.
    lease_ttl_ms = 10_000
    #: Free slots batch jobs never take (EDGEQ_RESERVED_SLOTS): a batch job is claimed only
    #: into the free slots beyond these, so a chat arriving while batch work fills the box
    #: starts at once.
    reserved_slots = 0
    #: False gives arq's own polling back (EDGEQ_FAST_PICKUP=false): for comparisons, and as
    #: a way out should a future arq change the internals overridden here.
    fast_pickup = True

    async def main(self) -> None:
        # arq's main() with its sleep replaced by _wait_for_work(); burst mode is not used here.
        if not self.fast_pickup:
            return await super().main()
        if self.burst:
            raise ValueError("edgeq's worker does not run in burst mode")
        arq_logger.info(
            "Starting worker for %d functions: %s", len(self.functions), ", ".join(self.functions)
        )
        await log_redis_info(self.pool, arq_logger.info)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        while True:
            await self._poll_iteration()
            await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        busy = bool(self.tasks) or not self.allow_pick_jobs
        wait_s = self.poll_delay_s if busy else IDLE_WAIT_S
        try:
            if self._wake is None:
                self._wake = self.pool.pubsub(ignore_subscribe_messages=True)
                await self._wake.subscribe(wake_channel(self.queue_name))
            await self._wake.get_message(timeout=wait_s)
        except REDIS_ERRORS:
            wake, self._wake = self._wake, None
            if wake is not None:
                await wake.aclose()
            await asyncio.sleep(WAIT_RETRY_S)

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        if not self.fast_pickup:
            return await super().start_jobs(job_ids)
        free_slots = self.max_jobs - self.job_counter
        candidates = [job_id.decode() for job_id in job_ids]
        candidates = [job_id for job_id in candidates if job_id not in self.tasks]
        if free_slots <= 0 or not candidates:
            return
        now_ms = timestamp_ms()
        claimed = await claim_due_jobs(
            self.pool,
            self.queue_name,
            candidates,
            wanted=free_slots,
            wanted_batch=max(0, free_slots - self.reserved_slots),
            ttl_ms=int(self.in_progress_timeout_s * 1000),
            lease_ttl_ms=self.lease_ttl_ms,
            now_ms=now_ms,
        )
        for job_id, _score in claimed:
            # What arq's start_jobs does with a job it took. job_counter < max_jobs, so the
            # semaphore (max_jobs + 1 permits) has a permit free and this does not wait.
            await self.sem.acquire()
            self.job_counter += 1
            # arq takes the score for the enqueue time (it logs "delayed" from it); edgeq's
            # scores are fair-queuing tags, so it gets the claim's time instead.
            task = self.loop.create_task(self.run_job(job_id, now_ms))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task

    async def close(self) -> None:
        if self._wake is not None:
            try:
                await self._wake.aclose()
            except REDIS_ERRORS:
                pass
        await super().close()
