"""Job leases against a real Redis: expiries on Redis's clock, and who gets declared lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from edgeq.core.events import EventLog, read_events
from edgeq.core.keys import (
    dead_letter_entry_key,
    dead_letter_key,
    in_progress_key,
    job_key,
    leases_key,
    retry_key,
)
from edgeq.core.leases import (
    Handover,
    abandoned,
    hand_over,
    lease_expired,
    mark_engine_failures,
    reap_lost_jobs,
    redis_now_ms,
    renew_leases,
)
from edgeq.core.protocol import DeltaEvent, ErrorEvent
from edgeq.testing.processes import RedisServer

# These tests name their jobs ("silent", "crashed", ...): each gets a database of its own,
# emptied first, so that a test run again (make test-stress repeats it) does not meet the
# records of its last run (it did: "its stream has already ended").
LEASES_DB = 7


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    connection = Redis.from_url(redis_server.url.rsplit("/", 1)[0] + f"/{LEASES_DB}")
    await connection.flushdb()
    yield connection
    await connection.aclose()


@pytest.fixture(autouse=True)
async def redis_up_a_second(redis: Redis) -> None:
    """Leases run out only once Redis has been up a lease TTL, counted in whole seconds; these
    tests use sub-second TTLs."""
    if (await redis.info("server"))["uptime_in_seconds"] < 1:
        await asyncio.sleep(1.0)


async def test_a_renewal_counts_from_when_redis_records_it_whatever_the_worker_clock(
    redis: Redis, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker whose clock is far off (or whose renewal sat in a stalled event loop
    # for as long) still gets a full TTL from the moment Redis has the renewal.
    monkeypatch.setattr(time, "time", lambda: 0.0)
    before_ms = await redis_now_ms(redis)
    await renew_leases(redis, queue, ["job-a", "job-b"], ttl_s=10)
    after_ms = await redis_now_ms(redis)  # Redis recorded it in between, however slow we are

    for job_id in ("job-a", "job-b"):
        expiry_ms = await redis.zscore(leases_key(queue), job_id)
        assert before_ms + 10_000 <= expiry_ms <= after_ms + 10_000
        assert not await lease_expired(redis, queue, job_id)


async def test_only_a_job_whose_lease_ran_out_is_declared_lost(redis: Redis, queue: str) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await renew_leases(redis, queue, ["silent"], ttl_s=0.2)
    await renew_leases(redis, queue, ["alive"], ttl_s=30)
    await asyncio.sleep(0.4)

    assert await lease_expired(redis, queue, "silent")
    assert not await lease_expired(redis, queue, "alive")
    reap = {
        "queue": queue,
        "max_continuations": 0,
        "deadline_s": 60,
        "lease_ttl_s": 0.2,
        "dead_letter_ttl_s": 60,
    }
    assert await reap_lost_jobs(redis, log, **reap) == {"silent": Handover.LOST}
    (event,) = await read_events(redis, "silent")
    assert isinstance(event, ErrorEvent) and event.code == "worker_lost"
    assert "EDGEQ_MAX_CONTINUATIONS=0" in event.message
    assert await read_events(redis, "alive") == []
    assert await reap_lost_jobs(redis, log, **reap) == {}


async def started_job(redis: Redis, queue: str, job_id: str, *, starts: int) -> None:
    """A job as arq leaves it running: payload, in the queue, in progress, started ``starts``
    times, with a lease that has already run out."""
    await redis.set(job_key(job_id), b"{}", px=5_000)
    await redis.zadd(queue, {job_id: 1})
    await redis.set(in_progress_key(job_id), b"1", px=60_000)
    await redis.set(retry_key(job_id), starts)
    await redis.zadd(leases_key(queue), {job_id: 1})  # expired in 1970


async def test_a_lost_job_is_handed_over_once_for_another_worker_to_continue(
    redis: Redis, queue: str
) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "crashed", starts=1)
    outcomes = await asyncio.gather(  # a client and two workers notice at the same moment
        *(hand_over(redis, log, "crashed", queue=queue, max_continuations=2, deadline_s=30,
                    lease_ttl_s=0.2, dead_letter_ttl_s=60) for _ in range(3))
    )  # fmt: skip
    assert sorted(outcomes) == [Handover.NOT_EXPIRED, Handover.NOT_EXPIRED, Handover.CONTINUED]
    assert not await redis.exists(in_progress_key("crashed"))  # any worker may claim it now
    assert await redis.zscore(queue, "crashed") == 1  # in its old place in the queue
    assert 25_000 < await redis.pttl(job_key("crashed")) <= 30_000  # taken within the deadline
    assert await redis.zscore(leases_key(queue), "crashed") is None
    assert await read_events(redis, "crashed") == []  # the stream goes on: no terminal event


async def test_a_job_started_past_the_limit_ends_worker_lost(redis: Redis, queue: str) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "poison", starts=3)
    outcome = await hand_over(
        redis,
        log,
        "poison",
        queue=queue,
        max_continuations=2,
        deadline_s=30,
        lease_ttl_s=0.2,
        dead_letter_ttl_s=60,
    )
    assert outcome is Handover.LOST
    (event,) = await read_events(redis, "poison")
    assert event.code == "worker_lost" and "started 3 times" in event.message
    assert not await redis.exists(job_key("poison"), in_progress_key("poison"))
    assert await redis.zscore(queue, "poison") is None  # never started again


async def test_a_handed_over_job_nobody_took_before_its_deadline_is_abandoned(
    redis: Redis, queue: str
) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "orphan", starts=1)
    await log.append(DeltaEvent(job_id="orphan", seq=0, text="half an ans"))
    await hand_over(
        redis,
        log,
        "orphan",
        queue=queue,
        max_continuations=2,
        deadline_s=2,  # not 0.2: a loaded machine may take that long to ask the next question
        lease_ttl_s=0.2,
        dead_letter_ttl_s=60,
    )
    assert not await abandoned(redis, queue, "orphan")  # waiting for a taker
    async with asyncio.timeout(30):  # its payload expires: nobody can continue it any more
        while not await abandoned(redis, queue, "orphan"):  # noqa: ASYNC110 (Redis expiry)
            await asyncio.sleep(0.1)
    await log.append(ErrorEvent(job_id="orphan", seq=0, code="worker_lost", message="x"))
    assert not await abandoned(redis, queue, "orphan")  # ended: nothing left to do


async def test_no_lease_runs_out_until_redis_has_been_up_a_lease_ttl(tmp_path: Path) -> None:
    # Nobody can renew a lease while Redis is away, and Redis's clock goes on meanwhile: after
    # a restart longer than the TTL, the live worker gets one TTL to renew before its chats
    # would be handed over.
    server = RedisServer(extra_args=("--appendonly", "yes", "--dir", str(tmp_path))).start()
    try:
        redis = Redis.from_url(server.url)
        queue, log = "edgeq:restarted", EventLog(redis, replay_ttl_s=60, queue="edgeq:restarted")
        await started_job(redis, queue, "running", starts=1)
        await redis.aclose()
        server.stop()  # its data is kept (append-only file)
        server.start()
        redis = Redis.from_url(server.url)
        handover = {
            "queue": queue,
            "max_continuations": 2,
            "deadline_s": 30,
            "dead_letter_ttl_s": 60,
        }
        assert await lease_expired(redis, queue, "running")  # expired in 1970, by the clock
        outcome = await hand_over(redis, log, "running", lease_ttl_s=2, **handover)
        assert outcome is Handover.NOT_EXPIRED  # Redis was up for less than the TTL
        assert await redis.exists(in_progress_key("running"))  # its worker still owns it
        await asyncio.sleep(2.1)
        outcome = await hand_over(redis, log, "running", lease_ttl_s=2, **handover)
        assert outcome is Handover.CONTINUED  # one TTL up and still not renewed: its worker died
        await redis.aclose()
    finally:
        server.stop()


async def test_a_job_whose_request_is_gone_ends_worker_lost_saying_so(
    redis: Redis, queue: str
) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "forgotten", starts=1)
    await redis.delete(job_key("forgotten"))
    outcome = await hand_over(
        redis,
        log,
        "forgotten",
        queue=queue,
        max_continuations=2,
        deadline_s=30,
        lease_ttl_s=0.2,
        dead_letter_ttl_s=60,
    )
    assert outcome is Handover.LOST_REQUEST
    (event,) = await read_events(redis, "forgotten")
    assert event.code == "worker_lost" and "request is no longer in Redis" in event.message


async def test_a_job_whose_stream_ended_while_its_worker_was_gone_leaves_no_records(
    redis: Redis, queue: str
) -> None:
    """Found by the chaos campaign (#34): a chat cancelled while its worker had given it up
    (Redis away past EDGEQ_REDIS_OUTAGE_S), or whose worker sent `done` and died before
    finishing arq's records, has a terminal event and a lease nobody renews. The lease's
    expiry must finish its records: its in-progress mark stayed for the claim's whole TTL
    (EDGEQ_JOB_TIMEOUT_S + 10 s), and the job in the queue."""
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "ended", starts=1)
    await log.append(DeltaEvent(job_id="ended", seq=0, text="half"))
    await log.append(ErrorEvent(job_id="ended", seq=0, code="cancelled", message="by a client"))
    outcome = await hand_over(
        redis,
        log,
        "ended",
        queue=queue,
        max_continuations=2,
        deadline_s=30,
        lease_ttl_s=0.2,
        dead_letter_ttl_s=60,
    )
    assert outcome is Handover.NOT_EXPIRED  # nothing to hand over: the job is over
    assert not await redis.exists(in_progress_key("ended"), job_key("ended"))
    assert await redis.zscore(queue, "ended") is None  # never claimed again
    assert await redis.zscore(leases_key(queue), "ended") is None
    assert [event.type for event in await read_events(redis, "ended")] == ["delta", "error"]


async def test_a_job_at_two_engine_failures_is_quarantined_not_continued(
    redis: Redis, queue: str
) -> None:
    # A poison request kills every engine it reaches: counted once, the job is continued (the
    # first failure may be the engine's own); counted twice, its payload goes to the
    # dead-letter set and it ends with its own code, once, whoever notices first.
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    handover = {"queue": queue, "max_continuations": 5, "deadline_s": 30, "lease_ttl_s": 0.2,
                "dead_letter_ttl_s": 60}  # fmt: skip
    await started_job(redis, queue, "poison", starts=1)
    await redis.set(job_key("poison"), b'{"a": [{"tenant": "acme"}]}', px=5_000)
    await mark_engine_failures(redis, ["poison"])
    assert await hand_over(redis, log, "poison", **handover) is Handover.CONTINUED
    await redis.zadd(leases_key(queue), {"poison": 1})  # its second worker's engine died too
    await mark_engine_failures(redis, ["poison"])
    outcomes = await asyncio.gather(
        *(hand_over(redis, log, "poison", **handover) for _ in range(3))
    )
    assert sorted(outcomes) == [Handover.NOT_EXPIRED] * 2 + [Handover.QUARANTINED]
    (event,) = await read_events(redis, "poison")
    assert isinstance(event, ErrorEvent) and event.code == "poison_job"
    assert "2 engines" in event.message
    assert await redis.zscore(queue, "poison") is None  # never started again
    assert not await redis.exists(job_key("poison"), in_progress_key("poison"))
    assert await redis.zscore(dead_letter_key(queue), "poison") is not None
    entry = await redis.hgetall(dead_letter_entry_key(queue, "poison"))
    assert entry[b"payload"] == b'{"a": [{"tenant": "acme"}]}' and entry[b"failures"] == b"2"
    assert 55_000 < await redis.pttl(dead_letter_entry_key(queue, "poison")) <= 60_000


async def test_a_job_whose_worker_was_killed_is_continued_however_often(
    redis: Redis, queue: str
) -> None:
    # No engine fault known (a SIGKILL, a power loss): nothing is counted, nothing quarantined.
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await started_job(redis, queue, "killed", starts=2)
    outcome = await hand_over(redis, log, "killed", queue=queue, max_continuations=2,
                              deadline_s=30, lease_ttl_s=0.2, dead_letter_ttl_s=60)  # fmt: skip
    assert outcome is Handover.CONTINUED
    assert await redis.zcard(dead_letter_key(queue)) == 0
