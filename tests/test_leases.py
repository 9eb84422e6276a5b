"""Job leases against a real Redis: expiries on Redis's clock, and who gets declared lost."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from edgeq.core.events import EventLog, read_events
from edgeq.core.keys import leases_key
from edgeq.core.leases import lease_expired, reap_lost_jobs, redis_now_ms, renew_leases
from edgeq.core.protocol import ErrorEvent


async def test_a_renewal_counts_from_when_redis_records_it_whatever_the_worker_clock(
    redis: Redis, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker whose clock is far off (or whose renewal sat in a stalled event loop
    # for as long) still gets a full TTL from the moment Redis has the renewal.
    monkeypatch.setattr(time, "time", lambda: 0.0)
    await renew_leases(redis, queue, ["job-a", "job-b"], ttl_s=10)

    now_ms = await redis_now_ms(redis)
    for job_id in ("job-a", "job-b"):
        expiry_ms = await redis.zscore(leases_key(queue), job_id)
        assert now_ms + 9_000 <= expiry_ms <= now_ms + 10_000
        assert not await lease_expired(redis, queue, job_id)


async def test_only_a_job_whose_lease_ran_out_is_declared_lost(redis: Redis, queue: str) -> None:
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await renew_leases(redis, queue, ["silent"], ttl_s=0.2)
    await renew_leases(redis, queue, ["alive"], ttl_s=30)
    await asyncio.sleep(0.4)

    assert await lease_expired(redis, queue, "silent")
    assert not await lease_expired(redis, queue, "alive")
    assert await reap_lost_jobs(redis, log, queue=queue) == ["silent"]
    (event,) = await read_events(redis, "silent")
    assert isinstance(event, ErrorEvent) and event.code == "worker_lost"
    assert await read_events(redis, "alive") == []
    assert await reap_lost_jobs(redis, log, queue=queue) == []
