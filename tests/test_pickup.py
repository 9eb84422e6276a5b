"""The worker's one-round-trip claim against a real Redis: which queued jobs it takes, that
two workers claiming at once never take the same job, and what makes a worker claim."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
from arq.constants import abort_jobs_ss
from redis.asyncio import Redis

from edgeq.core.connection import make_redis
from edgeq.core.events import EventLog
from edgeq.core.keys import in_progress_key, job_key, leases_key, retry_key, wake_channel
from edgeq.core.leases import redis_now_ms
from edgeq.core.protocol import dump_json, load_json
from edgeq.core.settings import ConnectionSettings
from edgeq.core.tasks import cancel_and_wait
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.testing.processes import RedisServer
from edgeq.worker.claim import START_COUNT_TTL_S, claim_due_jobs
from edgeq.worker.lifecycle import JobLoop, LoopConfig, StartedJob

NOW_MS = 1_800_000_000_000
TTL_MS = 60_000
LEASE_MS = 10_000


async def queued(redis: Redis, queue: str, count: int, *, score_ms: int = NOW_MS) -> list[str]:
    """``count`` job ids in the queue, in this order (arq's score: enqueue time in ms)."""
    job_ids = [f"job{n:03d}-{uuid.uuid4().hex[:6]}" for n in range(count)]
    await redis.zadd(queue, {job_id: score_ms + n for n, job_id in enumerate(job_ids)})
    return job_ids


async def claim(redis: Redis, queue: str, wanted: int, *, scan_limit: int = 100) -> list[str]:
    taken = await claim_due_jobs(
        redis, queue, wanted=wanted, wanted_batch=wanted, scan_limit=scan_limit,
        ttl_ms=TTL_MS, lease_ttl_ms=LEASE_MS, now_ms=NOW_MS + 10_000,
    )  # fmt: skip
    return [job.job_id for job in taken]


async def test_takes_as_many_as_wanted_in_queue_order_and_marks_them_in_progress(
    redis: Redis, queue: str
) -> None:
    job_ids = await queued(redis, queue, 5)

    before_ms = await redis_now_ms(redis)
    taken = await claim_due_jobs(
        redis, queue, wanted=3, wanted_batch=3, scan_limit=100, ttl_ms=TTL_MS,
        lease_ttl_ms=LEASE_MS, now_ms=NOW_MS + 10_000,
    )  # fmt: skip
    after_ms = await redis_now_ms(redis)

    assert [(job.job_id, job.score) for job in taken] == [
        (job_id, NOW_MS + n) for n, job_id in enumerate(job_ids[:3])
    ]
    for job_id in job_ids[:3]:
        assert 0 < await redis.pttl(in_progress_key(job_id)) <= TTL_MS
        # Leased in the same step, from Redis's clock: never taken without a lease.
        expiry = await redis.zscore(leases_key(queue), job_id)
        assert expiry is not None and before_ms + LEASE_MS <= expiry <= after_ms + LEASE_MS
    assert await redis.zcard(leases_key(queue)) == 3
    assert not await redis.exists(*(in_progress_key(job_id) for job_id in job_ids[3:]))
    # The next look takes what is left, then nothing.
    assert await claim(redis, queue, wanted=10) == job_ids[3:]
    assert await claim(redis, queue, wanted=10) == []


async def test_skips_jobs_taken_elsewhere_or_deferred(redis: Redis, queue: str) -> None:
    taken_elsewhere, due = await queued(redis, queue, 2)
    (deferred,) = await queued(redis, queue, 1, score_ms=NOW_MS + 60_000)
    await redis.set(in_progress_key(taken_elsewhere), b"1")  # e.g. by arq's own start_jobs

    assert await claim(redis, queue, 10) == [due]
    assert await redis.ttl(in_progress_key(taken_elsewhere)) == -1  # left as it was
    assert not await redis.exists(in_progress_key(deferred))
    assert await redis.zrange(leases_key(queue), 0, -1) == [due.encode()]


async def test_looks_at_no_more_of_the_queue_than_its_scan_limit(redis: Redis, queue: str) -> None:
    running = await queued(redis, queue, 5)
    (waiting,) = await queued(redis, queue, 1, score_ms=NOW_MS + 5)
    for job_id in running:  # taken by other workers, still in arq's queue while they run
        await redis.set(in_progress_key(job_id), b"1")

    assert await claim(redis, queue, 10, scan_limit=5) == []
    assert await claim(redis, queue, 10, scan_limit=6) == [waiting]


async def test_reads_what_arqs_run_job_would_in_the_same_step(redis: Redis, queue: str) -> None:
    fresh, started_before, aborted, expired = await queued(redis, queue, 4)
    for job_id in (fresh, started_before, aborted):
        await redis.set(job_key(job_id), f"payload of {job_id}".encode())
    await redis.set(retry_key(started_before), b"1")  # started once: a handed-over job
    await redis.zadd(abort_jobs_ss, {aborted: NOW_MS})

    taken = {
        job.job_id: job
        for job in await claim_due_jobs(
            redis, queue, wanted=10, wanted_batch=10, scan_limit=100, ttl_ms=TTL_MS,
            lease_ttl_ms=LEASE_MS, now_ms=NOW_MS + 10_000,
        )
    }  # fmt: skip

    assert taken[fresh].payload == f"payload of {fresh}".encode()
    assert (taken[fresh].job_try, taken[fresh].aborted) == (1, False)
    assert taken[started_before].job_try == 2
    assert taken[aborted].aborted and not await redis.zscore(abort_jobs_ss, aborted)
    assert taken[expired].payload is None  # its queue deadline removed the payload
    for job_id in taken:  # the start count lives as long as arq's own
        assert 0 < await redis.ttl(retry_key(job_id)) <= START_COUNT_TTL_S
    assert 0 < await redis.pttl(job_key(fresh)) <= TTL_MS  # kept while the job may run


async def test_two_workers_claiming_at_once_never_take_the_same_job(
    redis: Redis, redis_server, queue: str
) -> None:
    job_ids = await queued(redis, queue, 100)
    workers = [Redis.from_url(redis_server.url) for _ in range(2)]
    try:
        first, second = await asyncio.gather(
            *(claim(worker, queue, wanted=64, scan_limit=200) for worker in workers)
        )
    finally:
        for worker in workers:
            await worker.aclose()

    assert len(first) <= 64 and len(second) <= 64
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(job_ids)


class HeldJobs:
    """Jobs that start when the worker claims them and end when the test lets them."""

    def __init__(self) -> None:
        self.running: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.released: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def run(self, job: StartedJob) -> str:
        self.running[job.payload["name"]].set()
        await self.released[job.payload["name"]].wait()
        return job.payload["name"]

    async def started(self, name: str) -> None:
        await asyncio.wait_for(self.running[name].wait(), 10)


@pytest.fixture
async def held_worker(
    redis_server: RedisServer, queue: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[HeldJobs, JobQueue]]:
    """A fast-pickup worker with ``request.param`` slots that, while busy, would not poll for
    an hour: whatever it claims while a job runs, a signal made it claim."""
    jobs = HeldJobs()
    settings = ConnectionSettings(redis_url=redis_server.url, queue=queue)
    redis = make_redis(settings)
    loop = JobLoop(
        redis=redis,
        config=LoopConfig(queue=queue, max_jobs=request.param, poll_delay_s=3600),
        run_job=jobs.run,
        events=EventLog(redis, replay_ttl_s=60, queue=queue),
        deserializer=load_json,
        serializer=dump_json,
    )
    main = asyncio.create_task(loop.serve())
    producer = Redis.from_url(redis_server.url)
    try:
        yield jobs, JobQueue(producer, queue)
    finally:
        for released in jobs.released.values():
            released.set()
        await asyncio.gather(*loop.running.tasks(), return_exceptions=True)
        await cancel_and_wait(main)
        await redis.aclose()
        await producer.aclose()


async def submit(queue: JobQueue, name: str) -> None:
    outcome = await queue.enqueue(
        f"{name}-{uuid.uuid4().hex}", {"name": name},
        deadline_s=60, max_depth=0, tenant="", priority=None,
    )  # fmt: skip
    assert outcome.outcome is Enqueued.ACCEPTED


@pytest.mark.parametrize("held_worker", [2], indirect=True)
async def test_a_busy_worker_claims_a_new_job_on_its_enqueue(
    held_worker: tuple[HeldJobs, JobQueue],
) -> None:
    jobs, queue = held_worker
    await submit(queue, "first")
    await jobs.started("first")
    # "first" is never released: the worker stays busy, and only the wake message of the
    # enqueue, not a poll, can get "second" claimed.
    await submit(queue, "second")
    await jobs.started("second")


@pytest.mark.parametrize("held_worker", [1], indirect=True)
async def test_a_job_that_ends_makes_the_worker_claim_the_next_at_once(
    held_worker: tuple[HeldJobs, JobQueue],
) -> None:
    jobs, queue = held_worker
    await submit(queue, "first")
    await jobs.started("first")
    await submit(queue, "second")  # woken, but no slot: it waits
    await asyncio.sleep(0.3)
    assert not jobs.running["second"].is_set()
    jobs.released["first"].set()
    await jobs.started("second")


@pytest.mark.parametrize("held_worker", [4], indirect=True)
async def test_a_burst_of_enqueues_wakes_the_workers_once_and_every_job_of_it_starts(
    held_worker: tuple[HeldJobs, JobQueue], redis_server: RedisServer, queue: str
) -> None:
    jobs, jobs_queue = held_worker
    await submit(jobs_queue, "first")
    await jobs.started("first")  # busy from here on: only a wake gets a job claimed
    listener = Redis.from_url(redis_server.url)
    wakes = listener.pubsub(ignore_subscribe_messages=True)
    try:
        await wakes.subscribe(wake_channel(queue))
        await wakes.get_message(timeout=1)  # the confirmation, ignored
        # One loop turn: the three enqueues are one script call (core/batching.py).
        await asyncio.gather(*(submit(jobs_queue, name) for name in ("a", "b", "c")))
        for name in ("a", "b", "c"):
            await jobs.started(name)
        heard = []
        while (message := await wakes.get_message(timeout=0.3)) is not None:
            heard.append(message)
        assert len(heard) == 1, heard
    finally:
        await wakes.aclose()
        await listener.aclose()
