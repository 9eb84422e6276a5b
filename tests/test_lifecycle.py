"""A job's end when Redis goes away right after its terminal event, against a real Redis that
is stopped and started again with its data (append-only file): the job's records (arq's
result, queue entry, in-progress mark, payload) and its lease are never left behind."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from edgeq.core.connection import make_redis
from edgeq.core.events import EventLog
from edgeq.core.keys import in_progress_key, job_key, leases_key, result_key
from edgeq.core.leases import reap_lost_jobs
from edgeq.core.protocol import ErrorEvent, dump_json, load_json
from edgeq.core.settings import ConnectionSettings
from edgeq.core.tasks import cancel_and_wait
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.testing.processes import RedisServer
from edgeq.worker.lifecycle import JobLoop, LoopConfig, StartedJob

QUEUE = "edgeq:lifecycle"


@pytest.fixture
def kept_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own that keeps its data over a restart."""
    server = RedisServer(extra_args=("--appendonly", "yes", "--dir", str(tmp_path))).start()
    try:
        yield server
    finally:
        server.stop()


class EndsThenRedisGoes:
    """A job function that ends its job's stream, then stops Redis for ``away_s``: the
    loop must finish the job's records with Redis away."""

    def __init__(self, server: RedisServer, events: EventLog, away_s: float) -> None:
        self.server, self.events, self.away_s = server, events, away_s
        self.back = threading.Event()

    async def run(self, job: StartedJob) -> str:
        await self.events.append(
            ErrorEvent(job_id=job.job_id, seq=0, code="cancelled", message="ended by the test")
        )
        await asyncio.to_thread(self.server.stop)  # SIGTERM: the append-only file is flushed
        threading.Timer(self.away_s, self._start_again).start()
        return "ended"

    def _start_again(self) -> None:
        self.server.start()
        self.back.set()


@pytest.fixture
async def loop_on(kept_redis: RedisServer) -> AsyncIterator[tuple[JobLoop, Redis]]:
    redis = make_redis(ConnectionSettings(redis_url=kept_redis.url, queue=QUEUE))
    events = EventLog(redis, replay_ttl_s=60, queue=QUEUE)
    loop = JobLoop(
        redis=redis,
        config=LoopConfig(queue=QUEUE, max_jobs=1, poll_delay_s=0.1, lease_ttl_ms=1_000),
        run_job=lambda job: asyncio.sleep(0),  # each test sets its own
        events=events,
        deserializer=load_json,
        serializer=dump_json,
    )
    try:
        yield loop, redis
    finally:
        await redis.aclose()


async def run_one_job(loop: JobLoop, server: RedisServer, away_s: float) -> str:
    job_function = EndsThenRedisGoes(server, loop.events, away_s)
    loop.run_job = job_function.run
    producer = Redis.from_url(server.url)
    job_id = f"job-{uuid.uuid4().hex}"
    try:
        outcome = await JobQueue(producer, QUEUE).enqueue(
            job_id, {"name": "x"}, deadline_s=60, max_depth=0, tenant="", priority=None
        )
        assert outcome.outcome is Enqueued.ACCEPTED
    finally:
        await producer.aclose()
    serving = asyncio.create_task(loop.serve())
    try:
        await asyncio.wait_for(asyncio.to_thread(job_function.back.wait), 30)
        # The job's end: its records written, or given up on.
        ending = asyncio.gather(*loop.running.tasks(), return_exceptions=True)
        await asyncio.wait_for(ending, 10)
    finally:
        await cancel_and_wait(serving)
    return job_id


async def records_left(redis: Redis, job_id: str) -> list[str]:
    left = [key for key in (in_progress_key(job_id), job_key(job_id)) if await redis.exists(key)]
    if await redis.zscore(QUEUE, job_id) is not None:
        left.append("queue entry")
    return left


async def test_records_redis_could_not_take_at_a_jobs_end_are_written_once_it_is_back(
    loop_on: tuple[JobLoop, Redis], kept_redis: RedisServer
) -> None:
    loop, redis = loop_on
    # Away for less than a lease TTL: the loop retries, and arq's result is there after all.
    job_id = await run_one_job(loop, kept_redis, away_s=0.5)
    assert await redis.get(result_key(job_id)) is not None
    assert await records_left(redis, job_id) == []
    assert await redis.zscore(leases_key(QUEUE), job_id) is None


async def test_records_left_past_a_lease_ttl_are_finished_by_the_leases_expiry(
    loop_on: tuple[JobLoop, Redis], kept_redis: RedisServer
) -> None:
    """Found by the chaos campaign (#34): the job function released its lease before the loop
    wrote arq's records; when Redis went away in between, the job stayed queued and in
    progress, with no lease whose expiry would have finished it."""
    loop, redis = loop_on
    job_id = await run_one_job(loop, kept_redis, away_s=2.5)  # past the 1 s lease TTL
    assert await records_left(redis, job_id) != []  # the loop gave up on them...
    assert await redis.zscore(leases_key(QUEUE), job_id) is not None  # ...but kept the lease
    await asyncio.sleep(1.1)  # leases run out once Redis has been up a TTL (lua/hand_over.lua)
    await reap_lost_jobs(
        redis,
        loop.events,
        queue=QUEUE,
        max_continuations=2,
        deadline_s=30,
        lease_ttl_s=1.0,
        dead_letter_ttl_s=60,
    )
    assert await records_left(redis, job_id) == []
    assert await redis.zscore(leases_key(QUEUE), job_id) is None
