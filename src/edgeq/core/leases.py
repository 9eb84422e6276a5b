"""Leases: how a job whose worker died is continued, or still gets its terminal event.

A running job's worker renews its lease every ``EDGEQ_LEASE_TTL_S`` / 4. Anyone who sees a
lease run out (another worker's keep-alive round, or the waiting client itself) hands the job
over: one atomic step takes the expired lease (so only one of them acts) and, while the job
has been started at most ``EDGEQ_MAX_CONTINUATIONS`` times and its payload is kept, makes it
claimable again for any worker, which continues its stream where it stopped
(worker/jobs.py). Otherwise the job ends with ``worker_lost`` through the event log, so
exactly one terminal event still holds.
"""

from __future__ import annotations

from enum import IntEnum

from redis.asyncio import Redis

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import (
    events_key,
    in_progress_key,
    job_key,
    leases_key,
    retry_key,
    terminal_key,
    wake_channel,
)
from edgeq.core.protocol import ErrorEvent
from edgeq.core.scripts import lua_script, registered

# The lease scripts (Redis's clock, not the worker's, decides every lease: lua/clock.lua).
_RENEW = lua_script("clock", "renew_leases")
_HAND_OVER = lua_script("clock", "hand_over")


class Handover(IntEnum):
    NOT_EXPIRED = 0  # not run out (or Redis up for less than a TTL), or someone else acted
    CONTINUED = 1  # claimable again, to be continued
    LOST = 2  # started EDGEQ_MAX_CONTINUATIONS + 1 times: ended with worker_lost
    LOST_REQUEST = 3  # its request is no longer in Redis: ended with worker_lost


async def redis_now_ms(redis: Redis) -> int:
    seconds, microseconds = await redis.time()
    return int(seconds) * 1000 + int(microseconds) // 1000


async def renew_leases(redis: Redis, queue: str, job_ids: list[str], *, ttl_s: float) -> None:
    """A worker's promise that these jobs are alive for ``ttl_s`` from now (on Redis's clock)."""
    if job_ids:
        renew = registered(redis, _RENEW)
        await renew(keys=[leases_key(queue)], args=[int(ttl_s * 1000), *job_ids])


async def expire_leases(redis: Redis, queue: str, job_ids: list[str]) -> None:
    """Let these jobs' leases run out now: the next keep-alive round of any worker (or a
    waiting client) hands them over, as if their worker had died (a stalled worker's end)."""
    await renew_leases(redis, queue, job_ids, ttl_s=0)


async def release_lease(redis: Redis, queue: str, job_id: str) -> None:
    await redis.zrem(leases_key(queue), job_id)


async def lease_expired(redis: Redis, queue: str, job_id: str) -> bool:
    expiry_ms = await redis.zscore(leases_key(queue), job_id)
    return expiry_ms is not None and expiry_ms < await redis_now_ms(redis)


LOST_MESSAGE = (
    "the worker running this job stopped (crash, kill or power loss) before it finished, and "
    "it could not be continued ({why}); it is safe to submit it again"
)


async def abandoned(redis: Redis, queue: str, job_id: str) -> bool:
    """The job had started (its stream has events), has no lease, no terminal event and no
    payload any more: handed over, and nobody took it before the payload expired."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zscore(leases_key(queue), job_id)
        pipe.exists(job_key(job_id), terminal_key(job_id))
        pipe.xlen(events_key(job_id))
        leased, kept, events = await pipe.execute()
    return leased is None and kept == 0 and events > 0


async def declare_lost(
    redis: Redis, log: EventLog, job_id: str, *, queue: str, why: str = "no worker took it"
) -> bool:
    """End a job whose worker stopped renewing its lease, and make sure arq never runs it
    again. True if this call ended it."""
    event = ErrorEvent(
        job_id=job_id, seq=0, code="worker_lost", message=LOST_MESSAGE.format(why=why)
    )
    try:
        await log.append(event)
        ended = True
    except StreamClosed:
        ended = False
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(leases_key(queue), job_id)
        pipe.zrem(queue, job_id)
        pipe.delete(in_progress_key(job_id), job_key(job_id))
        await pipe.execute()
    return ended


async def hand_over(
    redis: Redis,
    log: EventLog,
    job_id: str,
    *,
    queue: str,
    max_continuations: int,
    deadline_s: float,
    lease_ttl_s: float,
) -> Handover:
    """A job whose lease ran out: make it claimable again for a worker to continue within
    ``deadline_s``, or, once it was started ``max_continuations`` + 1 times (a prompt that
    kills every worker it reaches) or its payload is gone, end it with ``worker_lost``."""
    script = registered(redis, _HAND_OVER)
    keys = [
        leases_key(queue), queue, in_progress_key(job_id), job_key(job_id),
        terminal_key(job_id), retry_key(job_id),
    ]  # fmt: skip
    args = [
        job_id, max_continuations, int(deadline_s * 1000), wake_channel(queue),
        int(lease_ttl_s * 1000),
    ]  # fmt: skip
    outcome = Handover(int(await script(keys=keys, args=args)))
    if outcome is Handover.LOST:
        why = f"it was started {max_continuations + 1} times (EDGEQ_MAX_CONTINUATIONS)"
        if not max_continuations:
            why = "EDGEQ_MAX_CONTINUATIONS=0"
        await declare_lost(redis, log, job_id, queue=queue, why=why)
    elif outcome is Handover.LOST_REQUEST:
        why = "its request is no longer in Redis (expired, or Redis restarted without its data)"
        await declare_lost(redis, log, job_id, queue=queue, why=why)
    return outcome


async def reap_lost_jobs(
    redis: Redis,
    log: EventLog,
    *,
    queue: str,
    max_continuations: int,
    deadline_s: float,
    lease_ttl_s: float,
) -> dict[str, Handover]:
    """Hand over every job whose lease ran out; returns what became of each this call took."""
    expired = await redis.zrangebyscore(leases_key(queue), "-inf", await redis_now_ms(redis))
    outcomes = {}
    for raw in expired:
        job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        outcome = await hand_over(
            redis, log, job_id, queue=queue,
            max_continuations=max_continuations, deadline_s=deadline_s, lease_ttl_s=lease_ttl_s,
        )  # fmt: skip
        if outcome is not Handover.NOT_EXPIRED:
            outcomes[job_id] = outcome
    return outcomes
