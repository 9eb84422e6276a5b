"""The publisher against a real Redis: first text at once, coalescing, one terminal event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from structlog.testing import capture_logs

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog, read_events
from edgeq.core.keys import events_key, stream_channel
from edgeq.core.protocol import DeltaEvent, DoneEvent, Timings, Usage
from edgeq.testing.processes import RedisServer
from edgeq.worker.publisher import RedisAway, StreamPublisher


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def stoppable_redis() -> AsyncIterator[tuple[RedisServer, Redis]]:
    """A Redis of the test's own, which it may stop and start (its data goes with it)."""
    server = RedisServer().start()
    redis = Redis.from_url(server.url)
    try:
        yield server, redis
    finally:
        await redis.aclose()
        server.stop()


def done_event(job_id: str, *, completion_tokens: int) -> DoneEvent:
    return DoneEvent(
        job_id=job_id,
        seq=0,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=completion_tokens),
        timings=Timings(queued_ms=0, ttft_ms=1, total_ms=2),
    )


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
    publisher = StreamPublisher(
        EventLog(redis, replay_ttl_s=60), "p1", interval_s=0.05, clock=clock
    )
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
    await publisher.publish_done(done_event("p1", completion_tokens=6))
    tail = await received(pubsub)
    assert [(e["type"], e["seq"]) for e in tail] == [("delta", 2), ("done", 3)]
    assert tail[0]["text"] == "f"
    await pubsub.aclose()


async def test_a_job_not_streamed_publishes_its_text_as_one_delta_with_its_end(
    redis: Redis,
) -> None:
    """``live=False`` (ChatRequest.stream false): nothing is published while the answer is
    made, then the whole text as one delta and the terminal event, and the replay buffer holds
    those two events only."""
    clock = FakeClock()
    publisher = StreamPublisher(
        EventLog(redis, replay_ttl_s=60), "quiet", interval_s=0.05, live=False, clock=clock
    )
    pubsub = await subscribed(redis, "quiet")
    for piece in ("One", " two", " three"):
        clock.now += 1.0  # well past the interval: a live stream would publish each
        await publisher.publish_text(piece)
    assert await received(pubsub) == []
    assert await redis.exists(events_key("quiet")) == 0
    await publisher.publish_done(done_event("quiet", completion_tokens=3))
    tail = await received(pubsub)
    assert [(e["type"], e["seq"]) for e in tail] == [("delta", 0), ("done", 1)]
    assert tail[0]["text"] == "One two three"
    assert [event.type for event in await read_events(redis, "quiet")] == ["delta", "done"]
    await pubsub.aclose()


async def test_exactly_one_terminal_event(redis: Redis) -> None:
    publisher = StreamPublisher(EventLog(redis, replay_ttl_s=60), "p2", interval_s=0)
    pubsub = await subscribed(redis, "p2")
    await publisher.publish_error("cancelled", "stopped")
    with pytest.raises(StreamClosed):
        await publisher.publish_error("timeout", "again")
    with pytest.raises(StreamClosed):
        await publisher.publish_text("late")
    assert [(e["type"], e["seq"]) for e in await received(pubsub)] == [("error", 0)]
    await pubsub.aclose()


async def test_a_stream_ended_elsewhere_refuses_the_workers_next_event(redis: Redis) -> None:
    """A cancel (or a reaper) ends the stream; the worker learns it at its next publish."""
    log = EventLog(redis, replay_ttl_s=60)
    publisher = StreamPublisher(log, "p3", interval_s=0)
    await publisher.publish_text("a")
    from edgeq.core.protocol import ErrorEvent

    await log.append(ErrorEvent(job_id="p3", seq=0, code="cancelled", message="by the client"))
    with pytest.raises(StreamClosed):
        await publisher.publish_text("b")
    assert publisher.closed
    events = await read_events(redis, "p3")
    assert [(e.type, e.seq) for e in events] == [("delta", 0), ("error", 1)]


async def test_the_replay_buffer_holds_every_event_with_its_seq(redis: Redis) -> None:
    log = EventLog(redis, replay_ttl_s=60)
    publisher = StreamPublisher(log, "p4", interval_s=0)
    for piece in "abc":
        await publisher.publish_text(piece)
    await publisher.publish_error("timeout", "too slow")
    assert [e.seq for e in await read_events(redis, "p4")] == [0, 1, 2, 3]
    assert [e.seq for e in await read_events(redis, "p4", after_seq=1)] == [2, 3]
    assert 0 < await redis.pttl("edgeq:events:{p4}") <= 60_000


async def test_batched_appends_from_many_jobs_keep_each_jobs_order(redis: Redis) -> None:
    """The worker's batched log: many jobs' appends share round trips, each job's order holds."""
    import asyncio

    log = EventLog(redis, replay_ttl_s=60)

    async def job(index: int) -> None:
        publisher = StreamPublisher(log, f"batch-{index}", interval_s=0)
        for piece in range(30):
            await publisher.publish_text(f"{piece},")
        await publisher.publish_error("cancelled", "end")

    await asyncio.gather(*(job(i) for i in range(20)))
    for index in range(20):
        events = await read_events(redis, f"batch-{index}")
        assert [e.seq for e in events] == list(range(31))
        assert "".join(e.text for e in events[:-1]) == "".join(f"{p}," for p in range(30))
        assert events[-1].type == "error"


async def test_appends_survive_a_flushed_script_cache(redis: Redis) -> None:
    """After a Redis restart its scripts are gone: the log loads its script again and the
    calls that found it missing are sent again, once each (no gap, no duplicate)."""
    log = EventLog(redis, replay_ttl_s=60)
    await log.append(DeltaEvent(job_id="p5", seq=0, text="a"))
    await redis.script_flush()
    published = await log.append_many(
        [DeltaEvent(job_id="p5", seq=0, text="b"), DeltaEvent(job_id="p5", seq=0, text="c")]
    )
    assert [item.seq for item in published] == [1, 2]
    assert [e.text for e in await read_events(redis, "p5")] == ["a", "b", "c"]


async def test_an_append_repeated_after_a_lost_reply_is_stored_once(redis: Redis) -> None:
    log = EventLog(redis, replay_ttl_s=60)
    events = [DeltaEvent(job_id="p-retry", seq=n, text=t) for n, t in enumerate("ab")]
    first = await log.append_many(events, at_seq=True)
    again = await log.append_many(events, at_seq=True)  # the reply was lost: sent again
    assert [p.seq for p in first] == [p.seq for p in again] == [0, 1]
    assert [e.text for e in await read_events(redis, "p-retry")] == ["a", "b"]
    with pytest.raises(StreamClosed):  # another event at a taken seq is not ours
        await log.append_many([DeltaEvent(job_id="p-retry", seq=1, text="x")], at_seq=True)


async def test_events_redis_lost_are_sent_again_in_order(redis: Redis) -> None:
    clock = FakeClock()
    publisher = StreamPublisher(
        EventLog(redis, replay_ttl_s=60), "p-lost", interval_s=0.05, clock=clock
    )
    for piece in ("A", "B"):
        await publisher.publish_text(piece)
        clock.now += 0.1
    await redis.delete(events_key("p-lost"))  # a restart without persistence, a failover
    await publisher.publish_text("C")
    await publisher.publish_done(done_event("p-lost", completion_tokens=3))
    events = await read_events(redis, "p-lost")
    assert [e.seq for e in events] == [0, 1, 2, 3]
    assert [getattr(e, "text", e.type) for e in events] == ["A", "B", "C", "done"]


async def test_text_made_while_redis_is_away_lands_in_order_when_it_is_back(
    stoppable_redis: tuple[RedisServer, Redis],
) -> None:
    server, redis = stoppable_redis
    clock = FakeClock()
    publisher = StreamPublisher(
        EventLog(redis, replay_ttl_s=60), "p-away", interval_s=0.05, outage_limit_s=10, clock=clock
    )
    await publisher.publish_text("A")
    server.stop()
    with capture_logs() as logs:
        for piece in ("B", "C", "D"):  # generation goes on: nothing raises
            clock.now += 0.5
            await publisher.publish_text(piece)
        assert publisher.redis_away_s > 0
        server.start()  # same port, its data gone: the publisher sends everything again
        done = await publisher.publish_done(done_event("p-away", completion_tokens=4))
    # The operator sees the outage once per job, with its cause, and its end.
    held, sent = logs
    assert held["event"] == "stream_events_held" and "ConnectionError" in held["reason"]
    assert sent["event"] == "stream_events_sent" and sent["held_s"] == 1.0
    events = await read_events(redis, "p-away")
    assert "".join(e.text for e in events[:-1]) == "ABCD"
    assert [e.seq for e in events] == list(range(len(events))) and done.seq == events[-1].seq
    assert publisher.redis_away_s == 0


async def test_an_outage_longer_than_the_limit_stops_the_job(
    stoppable_redis: tuple[RedisServer, Redis],
) -> None:
    server, redis = stoppable_redis
    clock = FakeClock()
    publisher = StreamPublisher(
        EventLog(redis, replay_ttl_s=60), "p-gone", interval_s=0.05, outage_limit_s=2, clock=clock
    )
    await publisher.publish_text("A")
    server.stop()
    clock.now += 0.5
    await publisher.publish_text("B")  # away 0 s: kept
    clock.now += 3
    with pytest.raises(RedisAway, match="EDGEQ_REDIS_OUTAGE_S"):
        await publisher.publish_text("C")


@pytest.mark.parametrize(
    "text",
    ["plain", 'quote " and \\ backslash', "line\nbreak\ttab\x00\x1f\x7f", "é 😀 \u2028 中文", ""],
)
def test_a_deltas_json_is_the_models_own(text: str) -> None:
    """Deltas skip pydantic's serializer (core/events.py): the bytes must be the same."""
    from edgeq.core.events import _event_json

    event = DeltaEvent(job_id="{q}job-1", seq=7, text=text)
    head, tail = _event_json(event)
    assert head + b'"seq":7,' + tail == event.model_dump_json(exclude_none=True).encode()
