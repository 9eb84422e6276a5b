"""worker/refill.py against a real Redis: what a finished job leaves in the worker is forgotten
once the same server has held it for the window, and kept while it has not (the restart itself
is tests/chaos/test_guarantees.py's, with a real worker)."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from edgeq.core.events import EventLog, read_events
from edgeq.core.ledger import LedgerScope, read_usage, usage_day
from edgeq.core.protocol import DeltaEvent, DoneEvent, Timings, Usage
from edgeq.testing.processes import RedisServer
from edgeq.worker.refill import RecentFinishes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stream(job_id: str) -> list[DeltaEvent | DoneEvent]:
    timings = Timings(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0)
    return [
        DeltaEvent(job_id=job_id, seq=0, text="hi"),
        DoneEvent(
            job_id=job_id,
            seq=1,
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=2),
            timings=timings,
        ),
    ]


async def test_kept_until_the_same_server_held_it_for_the_window(redis: Redis) -> None:
    clock = Clock()
    recent = RecentFinishes(EventLog(redis, replay_ttl_s=60), window_s=3.0, clock=clock)
    recent.keep_events("a", stream("a"), tenant=None)
    assert await recent.refill_if_restarted(redis) == 0  # the first look: who Redis is
    clock.now += 2.0
    recent.keep_events("b", stream("b"), tenant=None)
    assert await recent.refill_if_restarted(redis) == 0
    assert len(recent) == 2  # "a" was taken 2 s ago: maybe not on disk yet
    clock.now += 1.5
    assert await recent.refill_if_restarted(redis) == 0
    assert len(recent) == 1  # "a" 3.5 s ago: on disk; "b" 1.5 s ago: kept
    clock.now += 3.0
    assert await recent.refill_if_restarted(redis) == 0
    assert len(recent) == 0


async def test_a_window_of_zero_keeps_nothing(redis: Redis) -> None:
    recent = RecentFinishes(EventLog(redis, replay_ttl_s=60), window_s=0)
    recent.keep_events("a", stream("a"), tenant=None)

    async def write() -> None:
        raise AssertionError("never written again")

    recent.keep_records("a", write)
    assert len(recent) == 0


async def test_a_new_server_gets_every_kept_stream_and_record_again() -> None:
    server = RedisServer().start()  # its own: restarted below, empty, as without persistence
    try:
        async with Redis.from_url(server.url) as redis:
            events = EventLog(redis, replay_ttl_s=60, queue="q", usage_keep_s=86_400)
            recent = RecentFinishes(events, window_s=3.0)
            job = "refill-test-job"
            kept = stream(job)
            scope = LedgerScope("team-r", "tiny", "default")
            first_day = usage_day(time.time())  # with today: a run across midnight
            await events.append_many(kept, at_seq=True, tenant="team-r", ledger=scope)
            written: list[str] = []

            async def write() -> None:
                written.append(job)

            recent.keep_events(job, kept, tenant="team-r", ledger=scope)
            recent.keep_records(job, write)
            assert await recent.refill_if_restarted(redis) == 0  # the server that took them
            server.stop()
            server.start()  # the same port, a new run_id, nothing kept
            await redis.connection_pool.disconnect()  # its connections died with the server
            await events.append_many(kept[:1], at_seq=True)  # say it had only the delta
            assert await recent.refill_if_restarted(redis) == 1
            assert await read_events(redis, job) == kept  # the delta not twice, the done added
            assert written == [job]
            assert len(recent) == 0
            assert await recent.refill_if_restarted(redis) == 0  # nothing twice
            # The ledger's count went with the done event Redis lost; written again with it.
            [row] = await read_usage(redis, "q", sorted({first_day, usage_day(time.time())}))
            assert (row.tenant, row.requests, row.prompt_tokens) == ("team-r", 1, 3)
    finally:
        server.stop()
