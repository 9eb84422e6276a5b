"""Who is serving a queue: each worker's heartbeat record, and the recent outcome counts.

A worker writes its record every lease renewal (``EDGEQ_LEASE_TTL_S`` / 4) with a TTL of one
lease: a worker that stops renewing drops out of the list as its jobs are declared lost, so
"live" means the same thing for ``edgeq status``, the gateway's ``/ready`` and the leases.

Keys, per queue:

- ``{queue}:workers``: sorted set, worker id -> last heartbeat (Unix ms), the index;
- ``{queue}:worker:{id}``: the record (JSON), expiring one lease after the heartbeat;
- ``{queue}:outcomes:{minute}``: hash, outcome -> count of jobs that ended that minute,
  written by the event log's publish script with each terminal event (core/events.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from edgeq.core.keys import OUTCOME_BUCKET_S, leases_key, outcomes_key, worker_key, workers_key


class WorkerInfo(BaseModel):
    """One worker as ``edgeq status`` shows it."""

    worker_id: str
    host: str
    pid: int
    queue: str
    model: str
    profile: str | None
    device: str
    #: "stalled": its engine holds work and made no step for EDGEQ_ENGINE_STALL_S; it takes
    #: no jobs (worker/liveness.py). Only "ready" workers count for the gateway's /ready.
    state: Literal["starting", "ready", "draining", "stalled"]
    #: When it was found stalled (Unix seconds); None unless ``state`` is "stalled".
    stalled_since: float | None = None
    running: int
    running_by_tenant: dict[str, int] = {}
    #: The LoRA adapters it serves now, and those it refused with why (core/adapters.py).
    adapters: list[str] = []
    adapters_refused: dict[str, str] = {}
    max_jobs: int
    metrics_port: int | None
    started_at: float
    heartbeat_at: float


async def publish_heartbeat(redis: Redis, info: WorkerInfo, *, ttl_s: float) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        record = info.model_dump_json()
        pipe.set(worker_key(info.queue, info.worker_id), record, px=int(ttl_s * 1000))
        pipe.zadd(workers_key(info.queue), {info.worker_id: int(info.heartbeat_at * 1000)})
        await pipe.execute()


async def remove_worker(redis: Redis, queue: str, worker_id: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(worker_key(queue, worker_id))
        pipe.zrem(workers_key(queue), worker_id)
        await pipe.execute()


async def live_workers(redis: Redis, queue: str) -> list[WorkerInfo]:
    """The workers whose heartbeat is still fresh, oldest first; forgets the others."""
    ids = [raw.decode() for raw in await redis.zrange(workers_key(queue), 0, -1)]
    if not ids:
        return []
    records = await redis.mget([worker_key(queue, worker_id) for worker_id in ids])
    workers, gone = [], []
    for worker_id, record in zip(ids, records, strict=True):
        try:
            workers.append(WorkerInfo.model_validate_json(record))
        except (ValidationError, TypeError, ValueError):  # expired (None) or unreadable
            gone.append(worker_id)
    if gone:
        await redis.zrem(workers_key(queue), *gone)
    return workers


async def recent_outcomes(
    redis: Redis, queue: str, *, windows_s: Mapping[str, float], now_s: float | None = None
) -> dict[str, dict[str, int]]:
    """For each named window, how many jobs ended with each outcome (``done`` or an error
    code) in its last seconds, to the minute. The minute tallies are read once, for the
    longest window; the shorter ones are sums of its newest minutes."""
    now_s = time.time() if now_s is None else now_s
    minutes = {name: max(1, int(window // OUTCOME_BUCKET_S)) for name, window in windows_s.items()}
    async with redis.pipeline(transaction=False) as pipe:
        for back in range(max(minutes.values(), default=0)):
            pipe.hgetall(outcomes_key(queue, now_s - back * OUTCOME_BUCKET_S))
        newest_first = await pipe.execute()
    totals = {}
    for name, count in minutes.items():
        window: Counter[str] = Counter()
        for tally in newest_first[:count]:
            window.update({outcome.decode(): int(jobs) for outcome, jobs in tally.items()})
        totals[name] = dict(window.most_common())
    return totals


class QueueDepth(BaseModel):
    waiting: int  # accepted, not started by any worker yet
    running: int  # started, holding a lease


async def queue_depth(redis: Redis, queue: str) -> QueueDepth:
    # arq keeps running jobs in the queue's sorted set until they finish; the leases set
    # holds exactly the running ones.
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zcard(queue)
        pipe.zcard(leases_key(queue))
        accepted, running = await pipe.execute()
    return QueueDepth(waiting=max(0, int(accepted) - int(running)), running=int(running))
