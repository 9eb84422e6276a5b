"""Leases: how a job whose worker died is continued, or still gets its terminal event.

A running job's worker renews its lease every ``EDGEQ_LEASE_TTL_S`` / 4. Anyone who sees a
lease run out (another worker's keep-alive round, or the waiting client itself) hands the job
over: one atomic step takes the expired lease (so only one of them acts) and, while the job
has been started at most ``EDGEQ_MAX_CONTINUATIONS`` times and its payload is kept, makes it
claimable again for any worker, which continues its stream where it stopped
(worker/jobs.py). Otherwise the job ends with ``worker_lost`` through the event log, so
exactly one terminal event still holds.

A poison job (a request that kills or hangs the engine) would take down one warm engine per
continuation. So a worker whose engine died or stalled counts that failure on each job it was
running (``mark_engine_failures``, before it exits); a job counted at
``POISON_AFTER_ENGINE_FAILURES`` is not continued again: the hand-over moves its payload to the
queue's dead-letter set (core/dead_letter.py) and ends it with ``poison_job``. A worker that was
killed knows of no engine fault and counts nothing: its jobs are continued as before.
"""

from __future__ import annotations

from enum import IntEnum

from redis.asyncio import Redis

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.fingerprint import refuse_quarantined
from edgeq.core.keys import (
    dead_letter_entry_key,
    dead_letter_key,
    engine_failures_key,
    events_key,
    in_progress_key,
    job_key,
    leases_key,
    retry_key,
    tenancy_key,
    terminal_key,
    wake_channel,
)
from edgeq.core.ledger import unanswered_scope
from edgeq.core.protocol import ErrorCode, ErrorEvent
from edgeq.core.scripts import lua_script, registered

# The lease scripts (Redis's clock, not the worker's, decides every lease: lua/clock.lua).
_RENEW = lua_script("clock", "renew_leases")
_HAND_OVER = lua_script("clock", "hand_over")

#: Engine failures (deaths or stalls) a job may be running at before it is quarantined: the
#: first is as likely the engine's fault as the request's; a second on another engine points
#: at the request, and a poison request costs at most this many engine restarts.
POISON_AFTER_ENGINE_FAILURES = 2
#: How long a job's engine-failure count is kept: as long as arq keeps its start count.
ENGINE_FAILURES_TTL_S = 88_400


class Handover(IntEnum):
    NOT_EXPIRED = 0  # not run out (or Redis up for less than a TTL), or someone else acted
    CONTINUED = 1  # claimable again, to be continued
    LOST = 2  # started EDGEQ_MAX_CONTINUATIONS + 1 times: ended with worker_lost
    LOST_REQUEST = 3  # its request is no longer in Redis: ended with worker_lost
    QUARANTINED = 4  # at POISON_AFTER_ENGINE_FAILURES: in the dead-letter set, ended poison_job


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


async def mark_engine_failures(redis: Redis, job_ids: list[str]) -> None:
    """Count an engine failure (a death or a stall) on each job the engine was running: the
    failing worker's last Redis step before it exits."""
    if job_ids:
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.incr(engine_failures_key(job_id))
                pipe.expire(engine_failures_key(job_id), ENGINE_FAILURES_TTL_S)
            await pipe.execute()


async def hand_over_after_engine_failure(redis: Redis, queue: str, job_ids: list[str]) -> None:
    """Jobs whose engine died or stalled: the failure counted on each, then their leases let
    run out now, so the next keep-alive round of any worker hands them over (or quarantines
    one at its second failure). Counted first: a hand-over must never see the lease run out
    before the count that decides it."""
    await mark_engine_failures(redis, job_ids)
    await expire_leases(redis, queue, job_ids)


async def engine_failures(redis: Redis, job_id: str) -> int:
    """How many engine failures the job was running at."""
    return int(await redis.get(engine_failures_key(job_id)) or 0)


POISON_MESSAGE = (
    "the job was running on {failures} engines that died or stalled, so it was not continued "
    "again: its request was moved to the dead-letter set (edgeq dead-letter show {job_id}); "
    "sending it again unchanged will likely fail the same way"
)

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
        job_id=job_id, seq=0, code=ErrorCode.WORKER_LOST.value, message=LOST_MESSAGE.format(why=why)
    )
    return await _end_for_good(redis, log, event, queue=queue)


async def declare_poison(redis: Redis, log: EventLog, job_id: str, *, queue: str) -> bool:
    """End a quarantined job (its payload is in the dead-letter set already) with
    ``poison_job``. True if this call ended it."""
    failures = await engine_failures(redis, job_id)
    message = POISON_MESSAGE.format(failures=failures, job_id=job_id)
    event = ErrorEvent(job_id=job_id, seq=0, code=ErrorCode.POISON_JOB.value, message=message)
    return await _end_for_good(redis, log, event, queue=queue)


async def _end_for_good(redis: Redis, log: EventLog, event: ErrorEvent, *, queue: str) -> bool:
    """Append the job's terminal event and remove arq's records, so arq never runs it again.
    The event's step settles the job's reserved tokens (core/events.py); it is counted in the
    usage ledger under what its payload says, read first (a rare end: one round trip more)."""
    job_id = event.job_id
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(job_key(job_id))
        pipe.hmget(tenancy_key(queue), "model", "usage_keep_s")
        payload, (model, keep_s) = await pipe.execute()
    scope = unanswered_scope(payload, (model or b"").decode())
    try:
        await log.append(event, ledger=scope, ledger_keep_s=int(keep_s or 0))
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
    dead_letter_ttl_s: float,
    poison_refuse_s: float = 0.0,
) -> Handover:
    """A job whose lease ran out: make it claimable again for a worker to continue within
    ``deadline_s``, or, once it was started ``max_continuations`` + 1 times (a prompt that
    kills every worker it reaches) or its payload is gone, end it with ``worker_lost``; or,
    once it was running at ``POISON_AFTER_ENGINE_FAILURES`` engine failures, keep its payload
    in the dead-letter set for ``dead_letter_ttl_s`` and end it with ``poison_job``; the same
    request is then refused at the door for ``poison_refuse_s`` (EDGEQ_POISON_REFUSE_S; 0, the
    default, records nothing: core/fingerprint.py)."""
    script = registered(redis, _HAND_OVER)
    keys = [
        leases_key(queue), queue, in_progress_key(job_id), job_key(job_id),
        terminal_key(job_id), retry_key(job_id), engine_failures_key(job_id),
        dead_letter_key(queue), dead_letter_entry_key(queue, job_id),
    ]  # fmt: skip
    args = [
        job_id, max_continuations, int(deadline_s * 1000), wake_channel(queue),
        int(lease_ttl_s * 1000), POISON_AFTER_ENGINE_FAILURES, int(dead_letter_ttl_s * 1000),
    ]  # fmt: skip
    outcome = Handover(int(await script(keys=keys, args=args)))
    if outcome is Handover.QUARANTINED:
        # Recorded before the job ends: whoever sees poison_job and sends it again is refused.
        await refuse_quarantined(redis, queue, job_id, ttl_s=poison_refuse_s)
        await declare_poison(redis, log, job_id, queue=queue)
    elif outcome is Handover.LOST:
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
    dead_letter_ttl_s: float,
    poison_refuse_s: float = 0.0,
) -> dict[str, Handover]:
    """Hand over every job whose lease ran out; returns what became of each this call took."""
    expired = await redis.zrangebyscore(leases_key(queue), "-inf", await redis_now_ms(redis))
    outcomes = {}
    for raw in expired:
        job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        outcome = await hand_over(
            redis, log, job_id, queue=queue,
            max_continuations=max_continuations, deadline_s=deadline_s, lease_ttl_s=lease_ttl_s,
            dead_letter_ttl_s=dead_letter_ttl_s, poison_refuse_s=poison_refuse_s,
        )  # fmt: skip
        if outcome is not Handover.NOT_EXPIRED:
            outcomes[job_id] = outcome
    return outcomes
