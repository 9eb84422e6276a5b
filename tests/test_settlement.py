"""Every end of a job settles its reserved tokens and counts in the usage ledger, in the step
that writes its terminal event, whoever writes it (#42): a client's cancel, a keep-alive's
``worker_lost``, a worker's ``expired``; a tenant with no limits reserves nothing. Against a
real Redis and the real scripts, on queues no worker serves; the limits' windows read the
tenancy hash's frozen clock (docs/limits.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from edgeq.core.connection import make_redis
from edgeq.core.events import EventLog, finished_with
from edgeq.core.keys import job_key, limits_usage_key, reservation_key, tenancy_key
from edgeq.core.leases import declare_lost
from edgeq.core.ledger import UsageRow, read_usage, usage_day
from edgeq.core.limits import estimate_prompt_tokens
from edgeq.core.protocol import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Timings,
    Usage,
    dump_json,
    load_json,
)
from edgeq.core.scheduling import Tenancy, publish_tenancy
from edgeq.core.settings import ConnectionSettings
from edgeq.core.tasks import cancel_and_wait
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer
from edgeq.worker.lifecycle import JobLoop, LoopConfig

NOON = datetime(2026, 12, 6, 12, 0, 10, tzinfo=UTC)
PROMPT = "hi"
MODEL = "tiny-model"
KEEP_S = 7 * 86_400


@pytest.fixture
async def client(redis_server: RedisServer, queue: str) -> AsyncIterator[ChatClient]:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as chat_client:
        yield chat_client


async def limited(redis: Redis, queue: str, **limits: dict[str, int]) -> None:
    """The rules a worker with EDGEQ_MODEL=tiny-model would publish, the clock frozen."""
    tenancy = Tenancy(model=MODEL, usage_keep_s=KEEP_S, **limits)  # type: ignore[arg-type]
    await publish_tenancy(redis, queue, tenancy)
    await redis.hset(tenancy_key(queue), "limits_clock_ms", str(int(NOON.timestamp() * 1000)))


async def day_tokens(redis: Redis, queue: str, tenant: str) -> int:
    return int(await redis.hget(limits_usage_key(queue, tenant), "day_tokens") or 0)


async def rows(redis: Redis, queue: str) -> list[UsageRow]:
    today = usage_day(time.time())
    return await read_usage(redis, queue, sorted({today, usage_day(time.time() - 60)}))


def prompt_cost() -> int:
    return estimate_prompt_tokens({"messages": [{"role": "user", "content": PROMPT}]})


async def test_a_job_cancelled_while_queued_gives_its_reservation_back_and_counts_once(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, tokens_per_day={"acme": 10_000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=600, priority="batch")
    assert await day_tokens(redis, queue, "acme") == prompt_cost() + 600
    assert await client.cancel(job.job_id)
    # Never answered: nothing of it is charged, and it is gone with its reservation.
    assert await day_tokens(redis, queue, "acme") == 0
    assert not await redis.exists(reservation_key(queue, job.job_id))
    assert not await client.cancel(job.job_id)  # a second cancel ends and counts nothing
    [row] = await rows(redis, queue)
    assert (row.tenant, row.model, row.priority) == ("acme", MODEL, "batch")
    assert (row.requests, row.done, row.errors) == (1, 0, {"cancelled": 1})


async def test_an_expired_job_gives_its_reservation_back_and_counts_once(
    redis: Redis, redis_server: RedisServer, queue: str, client: ChatClient
) -> None:
    """A worker's loop reaching a job whose queue deadline passed finds its payload gone and
    ends it ``expired`` before it starts (worker/lifecycle.py): counted where it was queued."""
    await limited(redis, queue, tokens_per_day={"acme": 10_000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=300, priority="batch")
    await redis.delete(job_key(job.job_id))  # its deadline passed: what Redis's expiry does
    worker_redis = make_redis(ConnectionSettings(redis_url=redis_server.url, queue=queue))
    loop = JobLoop(
        redis=worker_redis,
        config=LoopConfig(queue=queue, max_jobs=1, poll_delay_s=0.1, model=MODEL),
        run_job=lambda started: asyncio.sleep(0),  # never reached: the job cannot start
        events=EventLog(worker_redis, replay_ttl_s=60, queue=queue, usage_keep_s=KEEP_S),
        deserializer=load_json,
        serializer=dump_json,
    )
    serving = asyncio.create_task(loop.serve())
    try:
        deadline = time.monotonic() + 30
        while (ended := await finished_with(redis, job.job_id)) is None:
            assert time.monotonic() < deadline, "the loop never ended the expired job"
            await asyncio.sleep(0.05)
    finally:
        await cancel_and_wait(serving)
        await worker_redis.aclose()
    assert isinstance(ended, ErrorEvent) and ended.code == "expired"
    assert await day_tokens(redis, queue, "acme") == 0
    assert not await redis.exists(reservation_key(queue, job.job_id))
    [row] = await rows(redis, queue)
    assert (row.tenant, row.model, row.priority) == ("acme", MODEL, "batch")
    assert (row.requests, row.errors) == (1, {"expired": 1})


async def test_a_job_declared_lost_keeps_its_reservation_and_counts_once(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, tokens_per_day={"acme": 10_000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=400, priority="interactive")
    log = EventLog(redis, replay_ttl_s=60, queue=queue)  # a client's or another worker's
    # Its worker streamed a delta, then died: how many tokens it streamed is not known, so the
    # reservation stands (given back, a cancel just before the end would be a free answer).
    await log.append(DeltaEvent(job_id=job.job_id, seq=0, text="par"))
    assert await declare_lost(redis, log, job.job_id, queue=queue)
    assert await day_tokens(redis, queue, "acme") == prompt_cost() + 400
    assert not await redis.exists(reservation_key(queue, job.job_id))
    assert not await declare_lost(redis, log, job.job_id, queue=queue)  # once
    assert await day_tokens(redis, queue, "acme") == prompt_cost() + 400
    [row] = await rows(redis, queue)
    assert (row.tenant, row.model, row.priority) == ("acme", MODEL, "interactive")
    assert (row.requests, row.errors) == (1, {"worker_lost": 1})


async def test_a_terminal_write_sent_again_settles_once(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, tokens_per_day={"acme": 10_000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=500)
    first = await client.submit(PROMPT, tenant="acme", max_tokens=500)
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    done = DoneEvent(
        job_id=job.job_id, seq=0, finish_reason="stop",
        usage=Usage(prompt_tokens=4, completion_tokens=6),
        timings=Timings(queued_ms=1.0, total_ms=2.0),
    )  # fmt: skip
    for _ in range(3):  # its replies were lost, say: the worker sends it again at its seq
        await log.append_many([done], at_seq=True, tenant="acme")
    assert await day_tokens(redis, queue, "acme") == 10 + prompt_cost() + 500
    assert await redis.exists(reservation_key(queue, first.job_id))  # the other one's stays


async def test_a_tenant_without_limits_reserves_nothing_and_its_end_settles_nothing(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, tokens_per_day={"acme": 10_000})
    job = await client.submit(PROMPT, tenant="free", max_tokens=500)
    assert not await redis.exists(reservation_key(queue, job.job_id))
    assert await client.cancel(job.job_id)
    assert not await redis.exists(limits_usage_key(queue, "free"))
    [row] = await rows(redis, queue)  # in the ledger all the same
    assert (row.tenant, row.requests, row.errors) == ("free", 1, {"cancelled": 1})
