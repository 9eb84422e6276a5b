"""One client, many streams, few connections: every stream a ChatClient follows rides on one
pub/sub connection, its commands on a small bounded pool, and nothing is lost for it — not by
the unconfirmed SUBSCRIBE, not by a dropped pub/sub connection. Real Redis; the test plays the
worker's side through the same event log the worker writes with."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

from edgeq.core import connection as connection_module
from edgeq.core.errors import RedisUnavailable
from edgeq.core.events import EventLog
from edgeq.core.keys import stream_channel
from edgeq.core.protocol import DeltaEvent, DoneEvent, StreamEvent, Timings, Usage
from edgeq.producer import client as client_module
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.producer.subscriptions import REPLAY
from edgeq.testing.processes import RedisServer
from helpers import FIGURES, assert_intact

IN_FLIGHT = 1000
DELTAS = 3
MAX_CONNECTIONS = 4


def done(job_id: str) -> DoneEvent:
    return DoneEvent(
        job_id=job_id,
        seq=0,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=DELTAS),
        timings=Timings(queued_ms=1, ttft_ms=2, total_ms=3),
    )


async def connections_named(redis: Redis, name: str) -> int:
    return sum(1 for client in await redis.client_list() if client.get("name") == name)


async def pubsub_connections(redis: Redis, name: str) -> list[dict[str, str]]:
    """CLIENT LIST's entries of the named client's pub/sub connections (flag P)."""
    return [
        client
        for client in await redis.client_list()
        if client.get("name") == name and client["flags"] == "P"
    ]


@pytest.fixture
async def named_client(redis_server: RedisServer, queue: str) -> AsyncIterator[ChatClient]:
    """A client on a queue no worker serves, its connections named for CLIENT LIST."""
    name = f"edgeq-mux-{uuid.uuid4().hex[:10]}"
    async with ChatClient(
        redis_url=f"{redis_server.url}?client_name={name}", queue=queue, max_queue=0
    ) as client:
        client.connection_name = name  # type: ignore[attr-defined]
        yield client


async def collect(job: ChatJob) -> list[StreamEvent]:
    return [event async for event in job.stream()]


async def follow(client: ChatClient, job_id: str, *, submitted: bool) -> ChatJob:
    """A job's stream as ``submit`` (``submitted``) or ``attach`` starts following it, with
    no enqueue and no read of the buffer beforehand: the test plays the worker."""
    inbox = await client.subscriptions.subscribe(job_id)
    return ChatJob(client, job_id, inbox, after_seq=-1, submitted=submitted)


async def test_a_thousand_streams_in_flight_hold_at_most_four_connections(
    named_client: ChatClient, redis: Redis
) -> None:
    name = named_client.connection_name  # type: ignore[attr-defined]
    started = time.perf_counter()
    jobs = await asyncio.gather(
        *(named_client.submit(f"question {n}", max_tokens=4) for n in range(IN_FLIGHT))
    )
    submitted_s = time.perf_counter() - started
    held = await connections_named(redis, name)
    assert held <= MAX_CONNECTIONS, f"{held} connections for {IN_FLIGHT} jobs in flight"

    readers = [asyncio.create_task(collect(job)) for job in jobs]
    worker_side = EventLog(redis, replay_ttl_s=60)
    for step in range(DELTAS):
        await asyncio.gather(
            *(worker_side.append(DeltaEvent(job_id=j.job_id, seq=0, text=f"{step}")) for j in jobs)
        )
    await asyncio.gather(*(worker_side.append(done(job.job_id)) for job in jobs))
    streams = await asyncio.wait_for(asyncio.gather(*readers), timeout=60)
    for job, events in zip(jobs, streams, strict=True):
        assert_intact(events, job.job_id)
        assert "".join(e.text for e in events if isinstance(e, DeltaEvent)) == "012"
    held_after = await connections_named(redis, name)
    assert held_after <= MAX_CONNECTIONS
    FIGURES[f"one ChatClient, {IN_FLIGHT} jobs in flight: Redis connections"] = (
        f"{held} while queued, {held_after} after streaming them all; "
        f"{IN_FLIGHT} submits in {submitted_s * 1000:.0f} ms"
    )
    await named_client.redis.delete(named_client.settings.queue)


@pytest.mark.parametrize("submitted", [False, True], ids=["attached", "submitted"])
async def test_a_stream_whose_events_all_came_before_the_subscription_still_arrives(
    named_client: ChatClient, redis: Redis, submitted: bool
) -> None:
    """SUBSCRIBE is not confirmed before the enqueue: were a whole (short) stream published
    before Redis took the subscription, it still arrives. An attached stream reads its replay
    buffer when the subscription is confirmed; a job its own client just submitted (subscribed
    before its enqueue) reads it when the stream stays silent."""
    job_id = uuid.uuid4().hex
    worker_side = EventLog(redis, replay_ttl_s=60)
    await worker_side.append(DeltaEvent(job_id=job_id, seq=0, text="early"))
    await worker_side.append(done(job_id))
    job = await follow(named_client, job_id, submitted=submitted)
    events = await asyncio.wait_for(collect(job), timeout=10)
    assert_intact(events, job_id)
    assert [event.type for event in events] == ["delta", "done"]


async def test_a_submit_whose_subscribe_cannot_be_written_enqueues_nothing(
    named_client: ChatClient, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The enqueue goes out with the SUBSCRIBE, not a loop turn after it, but never ahead of
    it: a job nobody could follow is not left to run."""

    async def refused(self: PubSub, *channels: object) -> None:
        raise RedisConnectionError("the pub/sub connection was refused")

    monkeypatch.setattr(PubSub, "subscribe", refused)
    with pytest.raises(RedisUnavailable, match="pub/sub connection was refused"):
        await named_client.submit("nobody would hear this", max_tokens=4)
    assert await redis.zcard(named_client.settings.queue) == 0
    assert not named_client.subscriptions._queues  # nothing left routed to a dead reader


async def test_a_submit_cancelled_before_its_subscribe_went_out_leaves_no_subscription(
    named_client: ChatClient, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SUBSCRIBE still waiting behind another one's write is dropped, not sent after the
    cancelled submit's UNSUBSCRIBE (which would leave its channel subscribed for good)."""
    write_subscribe = PubSub.subscribe

    async def slow(self: PubSub, *channels: object) -> None:
        await asyncio.sleep(0.1)
        await write_subscribe(self, *channels)

    monkeypatch.setattr(PubSub, "subscribe", slow)
    first = asyncio.create_task(named_client.submit("first", max_tokens=4))
    await asyncio.sleep(0.02)  # its SUBSCRIBE is being written
    second = asyncio.create_task(named_client.submit("second", max_tokens=4))
    await asyncio.sleep(0.02)  # its SUBSCRIBE waits for the next write
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    job = await first
    await asyncio.sleep(0.3)
    name = named_client.connection_name  # type: ignore[attr-defined]
    subscribed = [int(client["sub"]) for client in await pubsub_connections(redis, name)]
    assert subscribed == [2], subscribed  # the first job's channel only, and the anchor
    assert await redis.zcard(named_client.settings.queue) == 1  # the second never enqueued
    await job.aclose()
    await named_client.redis.delete(named_client.settings.queue)


async def xrange_calls(redis: Redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_xrange", {}).get("calls", 0))


async def test_a_submitted_stream_whose_first_event_was_missed_fills_it_from_the_buffer(
    named_client: ChatClient, redis: Redis
) -> None:
    job_id = uuid.uuid4().hex
    worker_side = EventLog(redis, replay_ttl_s=60)
    await worker_side.append(DeltaEvent(job_id=job_id, seq=0, text="a"))
    job = await follow(named_client, job_id, submitted=True)
    reader = asyncio.create_task(collect(job))
    await asyncio.sleep(0.2)  # the subscription is in effect: the rest arrives live
    await worker_side.append(DeltaEvent(job_id=job_id, seq=0, text="b"))
    await worker_side.append(done(job_id))
    events = await asyncio.wait_for(reader, timeout=10)
    assert_intact(events, job_id)
    assert "".join(e.text for e in events if isinstance(e, DeltaEvent)) == "ab"


async def test_a_gap_found_while_redis_is_away_is_filled_once_it_is_back(
    named_client: ChatClient, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a Redis restart a live event can arrive on a connection made before the outage
    while the read of the replay buffer for the events it skipped still fails. The stream
    rides that out, as a waiting client rides out any outage until EDGEQ_STREAM_TIMEOUT_S,
    instead of raising RedisUnavailable to its caller: one way a stream did so (issue #34)."""
    failures = 2
    real_read_events = client_module.read_events

    async def read_events_after_an_outage(*args: object, **kwargs: object) -> object:
        nonlocal failures
        if failures:
            failures -= 1
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1. Connection refused.")
        return await real_read_events(*args, **kwargs)

    monkeypatch.setattr(client_module, "read_events", read_events_after_an_outage)
    job_id = uuid.uuid4().hex
    worker_side = EventLog(redis, replay_ttl_s=60)
    await worker_side.append(DeltaEvent(job_id=job_id, seq=0, text="a"))  # missed by the client
    job = await follow(named_client, job_id, submitted=True)
    reader = asyncio.create_task(collect(job))
    await asyncio.sleep(0.2)  # the subscription is in effect: the rest arrives live
    await worker_side.append(DeltaEvent(job_id=job_id, seq=0, text="b"))  # a gap: seq 0 is missing
    await worker_side.append(done(job_id))
    events = await asyncio.wait_for(reader, timeout=20)
    assert failures == 0  # the buffer was read while "Redis was away", and failed
    assert_intact(events, job_id)
    assert "".join(e.text for e in events if isinstance(e, DeltaEvent)) == "ab"


async def test_submitted_streams_that_missed_nothing_never_read_the_replay_buffer(
    named_client: ChatClient, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of submits costs no replay-buffer read per job when every event came live:
    those reads used to compete with the worker for the box's cores as it started the
    burst."""
    # A stream silent for this long reads the buffer (its own test): not within this test,
    # even if a loaded CI machine stops this process for a second.
    monkeypatch.setattr(client_module, "LEASE_CHECK_INTERVAL_S", 60.0)
    reads_before = await xrange_calls(redis)
    jobs = await asyncio.gather(*(named_client.submit(f"q{n}", max_tokens=4) for n in range(20)))
    readers = [asyncio.create_task(collect(job)) for job in jobs]
    await asyncio.sleep(0.2)  # every confirmation came (and a replay it asked for at once)
    worker_side = EventLog(redis, replay_ttl_s=60)
    for job in jobs:
        await worker_side.append(DeltaEvent(job_id=job.job_id, seq=0, text="a"))
        await worker_side.append(done(job.job_id))
    streams = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
    for job, events in zip(jobs, streams, strict=True):
        assert_intact(events, job.job_id)
    assert await xrange_calls(redis) == reads_before
    await named_client.redis.delete(named_client.settings.queue)


async def test_a_dropped_pubsub_connection_loses_no_event(
    named_client: ChatClient, redis: Redis
) -> None:
    jobs = [await named_client.submit(f"q{n}", max_tokens=4) for n in range(5)]
    readers = [asyncio.create_task(collect(job)) for job in jobs]
    worker_side = EventLog(redis, replay_ttl_s=60)
    for job in jobs:
        await worker_side.append(DeltaEvent(job_id=job.job_id, seq=0, text="a"))
    await asyncio.sleep(0.2)
    name = named_client.connection_name  # type: ignore[attr-defined]
    (pubsub_id,) = [client["id"] for client in await pubsub_connections(redis, name)]
    assert await redis.client_kill_filter(_id=pubsub_id) == 1
    for job in jobs:  # published while the client is reconnecting: only the buffer has them
        await worker_side.append(DeltaEvent(job_id=job.job_id, seq=0, text="b"))
        await worker_side.append(done(job.job_id))
    streams = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
    for job, events in zip(jobs, streams, strict=True):
        assert_intact(events, job.job_id)
        assert "".join(e.text for e in events if isinstance(e, DeltaEvent)) == "ab"
    await named_client.redis.delete(named_client.settings.queue)


async def test_closing_a_stream_after_its_client_is_a_no_op(redis_server: RedisServer) -> None:
    client = ChatClient(redis_url=redis_server.url, queue=f"edgeq:test-{uuid.uuid4().hex[:8]}")
    jobs = [await client.submit(f"q{n}", max_tokens=4) for n in range(3)]
    await asyncio.gather(client.aclose(), *(job.aclose() for job in jobs))
    await jobs[0].aclose()  # again, after everything: still nothing to do


async def test_two_readers_of_one_job_in_one_client_each_get_the_whole_stream(
    named_client: ChatClient, redis: Redis
) -> None:
    """A stream and an attach of the same job share the client's subscription of its channel;
    closing one leaves the other subscribed."""
    job = await named_client.submit("twice", max_tokens=4)
    worker_side = EventLog(redis, replay_ttl_s=60)
    await worker_side.append(DeltaEvent(job_id=job.job_id, seq=0, text="a"))
    attached = await named_client.attach(job.job_id)
    closed_early = await named_client.attach(job.job_id)
    await closed_early.aclose()
    await worker_side.append(DeltaEvent(job_id=job.job_id, seq=0, text="b"))
    await worker_side.append(done(job.job_id))
    first, second = await asyncio.wait_for(
        asyncio.gather(collect(job), collect(attached)), timeout=10
    )
    assert first == second
    assert_intact(first, job.job_id)
    assert "".join(e.text for e in first if isinstance(e, DeltaEvent)) == "ab"


async def test_a_reader_cancelled_as_its_next_event_arrives_stops(named_client: ChatClient) -> None:
    """What the gateway does when its HTTP client leaves: cancel the task reading the stream,
    then cancel the job. The cancel must win even when something lands in the stream's inbox
    in the same loop turn (as the subscription's confirmation does right after a submit). In
    that race Python 3.11's ``asyncio.wait_for`` returns the item instead of raising: the
    reader went on waiting, up to EDGEQ_STREAM_TIMEOUT_S, and the gateway's job stayed queued."""
    job = await named_client.submit("leave now", max_tokens=4)
    reader = asyncio.create_task(anext(job.stream()))
    await asyncio.sleep(0.2)  # confirmed and replayed: the reader waits on its inbox
    assert not reader.done()
    job._inbox.put_nowait(REPLAY)  # what the client's pub/sub reader does on a confirmation
    reader.cancel()
    async with asyncio.timeout(5):
        await asyncio.gather(reader, return_exceptions=True)
    assert reader.cancelled()
    await named_client.redis.delete(named_client.settings.queue)


async def test_a_submit_after_the_loop_stalled_between_two_streams_is_subscribed(
    redis_server: RedisServer, redis: Redis, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that followed nothing while its event loop was blocked for longer than the
    health-check interval (a producer's CPU-bound step) submits again. redis-py checks the
    connection's health before that SUBSCRIBE and reads the answer itself, beside the reader
    task waiting on the same socket; the submit failed with "read() called while another
    coroutine is already waiting" (producer/subscriptions.py)."""
    monkeypatch.setattr(connection_module, "REDIS_HEALTH_CHECK_INTERVAL_S", 1)
    worker_side = EventLog(redis, replay_ttl_s=60)
    async with ChatClient(redis_url=redis_server.url, queue=queue, max_queue=0) as client:
        first = await client.submit("before", max_tokens=4)
        await worker_side.append(done(first.job_id))
        assert_intact(await asyncio.wait_for(collect(first), timeout=10), first.job_id)
        channel = stream_channel(first.job_id)
        async with asyncio.timeout(10):  # its UNSUBSCRIBE taken: the client follows nothing
            while dict(await redis.pubsub_numsub(channel))[channel.encode()]:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # and the reader has read Redis's confirmation of it
        time.sleep(1.5)  # noqa: ASYNC251 (the stall is the point)
        second = await client.submit("after", max_tokens=4)
        await worker_side.append(done(second.job_id))
        assert_intact(await asyncio.wait_for(collect(second), timeout=10), second.job_id)
        await client.redis.delete(queue)
