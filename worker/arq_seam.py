"""Where the worker meets arq: a job's records in Redis, written the way arq writes them.

Producers enqueue with arq (``ArqRedis.enqueue_job("chat", …)``, or edgeq's client, which
writes the same records) and may read outcomes with arq's ``Job.status()`` and
``Job.result()``. The worker runs its own loop (worker/lifecycle.py) and keeps arq's side of
that contract here, with arq's public functions and key constants only:

- a job's payload, ``arq:job:<id>``: read with arq's ``deserialize_job_raw``;
- its result, ``arq:result:<id>``: arq's envelope (``serialize_result``: ``t``, ``f``, ``a``,
  ``k``, ``et``, ``s``, ``r``, ``st``, ``ft``, ``q``, ``id``), the outcome under ``r``;
- its end: one transaction removes everything ``Job.status()`` reads as queued or in
  progress (the queue entry, ``arq:in-progress:<id>``, ``arq:job:<id>``, ``arq:retry:<id>``,
  a pending abort) and writes the result, so the status goes from in progress to complete;
- its claim: the claim script (worker/claim.py) sets ``arq:in-progress:<id>``, counts the start
  in ``arq:retry:<id>`` and reads ``arq:job:<id>``, with the prefixes given here;
- aborts: arq's ``Job.abort`` adds the id to ``arq:abort`` (on a Redis Cluster the queue's
  own set, core/keys.py); the claim takes an abort that waits for a queued job
  (worker/claim.py), ``take_aborts`` those of running jobs.

``tests/test_arq_contract.py`` pins what an arq producer sees.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.jobs import SerializationError, deserialize_job_raw, serialize_result
from redis.asyncio import Redis

from edgeq.core.keys import in_progress_key, job_key, leases_key, result_key, retry_key

__all__ = [
    "ARQ_ABORT_SET",
    "IN_PROGRESS_KEY_PREFIX",
    "JOB_KEY_PREFIX",
    "RETRY_KEY_PREFIX",
    "START_COUNT_TTL_S",
    "JobRecord",
    "SerializationError",
    "finish_job",
    "read_job",
    "result_record",
    "take_aborts",
]

#: arq's one abort set for every queue.
ARQ_ABORT_SET = abort_jobs_ss
#: arq's per-job key prefixes, for the claim script, which builds each job's keys from its id.
IN_PROGRESS_KEY_PREFIX = in_progress_key_prefix
JOB_KEY_PREFIX = job_key_prefix
RETRY_KEY_PREFIX = retry_key_prefix
#: How long arq keeps a job's start count (its retry key), as its ``run_job`` does.
START_COUNT_TTL_S = 88_400

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What ``arq:job:<id>`` holds: the function to call, its arguments, the start count the
    producer set (None for most) and when it was enqueued (Unix ms)."""

    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    enqueued_try: int | None
    enqueued_ms: int


def read_job(raw: bytes, deserializer: Deserializer) -> JobRecord:
    """The job a payload holds; raises arq's ``SerializationError`` if it cannot be read."""
    function, args, kwargs, enqueued_try, enqueued_ms = deserialize_job_raw(
        raw, deserializer=deserializer
    )
    return JobRecord(function, tuple(args), dict(kwargs), enqueued_try, enqueued_ms)


def result_record(
    job_id: str,
    record: JobRecord | None,
    *,
    queue: str,
    job_try: int,
    success: bool,
    result: Any,
    started_ms: int,
    finished_ms: int,
    serializer: Serializer,
) -> bytes | None:
    """arq's result envelope for a job (None if even arq's fallback could not serialize it).
    ``record`` is None for a job whose payload was gone or unreadable."""
    return serialize_result(
        record.function if record else "<unknown>",
        record.args if record else (),
        record.kwargs if record else {},
        job_try,
        record.enqueued_ms if record else 0,
        success,
        result,
        started_ms,
        finished_ms,
        f"{job_id}:{record.function if record else '<unknown>'}",
        queue,
        job_id=job_id,
        serializer=serializer,
    )


async def finish_job(
    redis: Redis,
    job_id: str,
    *,
    queue: str,
    abort_set: str,
    result: bytes | None,
    keep_result_ms: int,
) -> None:
    """End a job in arq's records, in one transaction: its result kept for
    ``keep_result_ms`` (none if 0 or no result), its payload, start count, in-progress mark,
    queue entry and pending abort gone, and edgeq's lease on it with them. The lease goes
    last of all: while the records stay (Redis away at the job's end), the lease's expiry
    finishes them (core/lua/hand_over.lua), where a lease released earlier left the job
    queued and in progress for good."""
    async with redis.pipeline(transaction=True) as transaction:
        if result is not None and keep_result_ms > 0:
            transaction.set(result_key(job_id), result, px=keep_result_ms)
        transaction.delete(in_progress_key(job_id), retry_key(job_id), job_key(job_id))
        transaction.zrem(abort_set, job_id)
        transaction.zrem(queue, job_id)
        transaction.zrem(leases_key(queue), job_id)
        await transaction.execute()


async def take_aborts(redis: Redis, abort_set: str, running: Collection[str]) -> set[str]:
    """The running jobs an abort waits for, taken out of the abort set. Aborts of jobs that
    run elsewhere stay for their worker; those of queued jobs for the claim that takes them."""
    if not running:
        return set()
    waiting = {job_id.decode() for job_id in await redis.zrange(abort_set, 0, -1)}
    aborted = waiting & set(running)
    if aborted:
        await redis.zrem(abort_set, *aborted)
    return aborted
