"""The publisher against a real Redis: first text at once, coalescing, one terminal event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from producer.protocol import Timings, Usage, stream_channel
from worker.publisher import StreamClosed, StreamPublisher


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def redis(redis_server) -> AsyncIterator[Redis]:
    connection = Redis.from_url(redis_server.url)
    yield connection
    await connection.aclose()


async def subscribed(redis: Redis, job_id: str) -> PubSub:
    pubsub = redis.pubsub()
    await pubsub.subscribe(stream_channel(job_id))
    await pubsub.get_message(timeout=5)
    return pubsub


async def received(pubsub: PubSub) -> list[dict]:
    events = []
    while message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2):
        events.append(json.loads(message["data"]))
    return events


async def test_first_text_at_once_then_at_most_one_delta_per_interval(redis: Redis) -> None:
    clock = FakeClock()
    publisher = StreamPublisher(redis, "p1", interval_s=0.05, clock=clock)
    pubsub = await subscribed(redis, "p1")

    await publisher.publish_text("A")  # first text: published at once
    assert [e["text"] for e in await received(pubsub)] == ["A"]

    for piece in ("b", "c", "d"):
        clock.now += 0.01
        await publisher.publish_text(piece)
    assert await received(pubsub) == []  # still inside the interval: held back

    clock.now += 0.03
    await publisher.publish_text("e")
    assert [e["text"] for e in await received(pubsub)] == ["bcde"]

    await publisher.publish_text("")  # nothing to say is not an event
    clock.now += 0.001
    await publisher.publish_text("f")
    await publisher.publish_done(
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=6),
        timings=Timings(queued_ms=0, ttft_ms=1, total_ms=2),
        reasoning=None,
    )
    tail = await received(pubsub)
    assert [(e["type"], e["seq"]) for e in tail] == [("delta", 2), ("done", 3)]
    assert tail[0]["text"] == "f"
    await pubsub.aclose()


async def test_exactly_one_terminal_event(redis: Redis) -> None:
    publisher = StreamPublisher(redis, "p2", interval_s=0)
    pubsub = await subscribed(redis, "p2")
    await publisher.publish_error("cancelled", "stopped")
    with pytest.raises(StreamClosed):
        await publisher.publish_error("timeout", "again")
    with pytest.raises(StreamClosed):
        await publisher.publish_text("late")
    assert [(e["type"], e["seq"]) for e in await received(pubsub)] == [("error", 0)]
    await pubsub.aclose()
