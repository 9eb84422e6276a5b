"""Idempotent submits against a real Redis (no worker: the jobs stay queued): a key given
once per tenant within EDGEQ_IDEMPOTENCY_TTL_S enqueues one job, whoever sends it how often."""

from __future__ import annotations

import asyncio

import pytest

from edgeq.core.errors import IdempotencyConflict, InvalidRequest
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer

STORM = 50


async def test_the_same_key_sent_50_times_at_once_enqueues_one_job(
    redis_server: RedisServer, queue: str
) -> None:
    # A caller retrying a submit after a timeout, many times over, from many connections.
    clients = [ChatClient(redis_url=redis_server.url, queue=queue) for _ in range(5)]
    try:
        jobs = await asyncio.gather(
            *(
                clients[i % len(clients)].submit("once only", idempotency_key="order-42")
                for i in range(STORM)
            )
        )
        ids = {job.job_id for job in jobs}
        assert len(ids) == 1, ids
        assert await clients[0].redis.zcard(queue) == 1
        assert await clients[0].redis.zrange(queue, 0, -1) == [ids.pop().encode()]
        for job in jobs:
            await job.aclose()
    finally:
        for client in clients:
            await client.aclose()


async def test_the_same_key_with_another_request_is_refused_and_enqueues_nothing(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        first = await client.submit("the first request", idempotency_key="k1")
        with pytest.raises(IdempotencyConflict) as refused:
            await client.submit("another request", idempotency_key="k1")
        assert refused.value.job_id == first.job_id
        assert "different request" in str(refused.value)
        assert await client.redis.zcard(queue) == 1
        await first.aclose()


async def test_tenants_keys_never_meet(redis_server: RedisServer, queue: str) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        acme = await client.submit("same", tenant="acme", idempotency_key="k")
        globex = await client.submit("same", tenant="globex", idempotency_key="k")
        assert acme.job_id != globex.job_id
        assert await client.redis.zcard(queue) == 2
        for job in (acme, globex):
            await job.aclose()


async def test_a_key_past_its_ttl_enqueues_again(redis_server: RedisServer, queue: str) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue, idempotency_ttl_s=0.2) as client:
        first = await client.submit("again later", idempotency_key="k")
        await asyncio.sleep(0.3)
        second = await client.submit("again later", idempotency_key="k")
        assert first.job_id != second.job_id
        for job in (first, second):
            await job.aclose()


async def test_a_key_that_is_not_visible_ascii_is_refused_naming_it(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        for bad in ("", "with space", "x" * 256, "naïve"):
            with pytest.raises(InvalidRequest, match="idempotency_key"):
                await client.submit("hi", idempotency_key=bad)
        assert await client.redis.zcard(queue) == 0
