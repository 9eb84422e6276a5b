"""Priority classes, tenants' fair shares, aging and caps, against a real Redis: the enqueue
script places each job, the worker's claim script takes them, in the order a worker would
(arq's ZRANGEBYSCORE over the queue, lowest first). The same scripts run under real workers
in tests/test_priorities.py."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest
from arq.utils import timestamp_ms
from redis.asyncio import Redis

from edgeq.core.events import EventLog
from edgeq.core.keys import aging_key, fair_key, tenant_of_key
from edgeq.core.scheduling import (
    BAND_SPAN,
    Priority,
    Tenancy,
    publish_tenancy,
    queued_by_tenant,
    read_tenancy,
)
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.worker.claim import claim_due_jobs

REQUEST = {"messages": [{"role": "user", "content": "hi"}]}


async def enqueue(
    jobs: JobQueue, tenant: str, priority: Priority | None = None, *, count: int = 1
) -> list[str]:
    job_ids = []
    for _ in range(count):
        job_id = f"{tenant}-{priority or 'default'}-{uuid.uuid4().hex[:8]}"
        outcome = await jobs.enqueue(
            job_id, REQUEST, deadline_s=60, max_depth=0, tenant=tenant, priority=priority
        )
        assert outcome.outcome is Enqueued.ACCEPTED
        job_ids.append(job_id)
    return job_ids


async def claim(redis: Redis, queue: str, wanted: int, *, batch_slots: int = 10**6) -> list[str]:
    """One worker's poll: edgeq's claim of the lowest scores."""
    taken = await claim_due_jobs(
        redis, queue, wanted=wanted, wanted_batch=batch_slots, scan_limit=10_000,
        ttl_ms=60_000, lease_ttl_ms=10_000, now_ms=timestamp_ms(),
    )  # fmt: skip
    for job in taken:  # finished at once: out of the queue, as arq's finish does
        await redis.zrem(queue, job.job_id)
    return [job.job_id for job in taken]


def tenants(job_ids: list[str]) -> Counter[str]:
    return Counter(job_id.split("-")[0] for job_id in job_ids)


async def test_higher_classes_are_claimed_first_and_arrival_order_holds_within_one(
    redis: Redis, queue: str
) -> None:
    jobs = JobQueue(redis, queue)
    batch = await enqueue(jobs, "t", "batch", count=3)
    default = await enqueue(jobs, "t", None, count=3)
    interactive = await enqueue(jobs, "t", "interactive", count=3)

    assert await claim(redis, queue, 9) == interactive + default + batch
    # Every score stays under any "now" arq compares with: all of them are due at once.
    assert 2 * BAND_SPAN + 9 < timestamp_ms()


async def test_tenants_with_work_queued_are_taken_by_weight_3_to_1(
    redis: Redis, queue: str
) -> None:
    await publish_tenancy(redis, queue, Tenancy(weights={"a": 3, "b": 1}))
    jobs = JobQueue(redis, queue)
    await enqueue(jobs, "b", count=100)  # b first: arrival order does not buy a bigger share
    await enqueue(jobs, "a", count=100)

    first = await claim(redis, queue, 40)
    assert tenants(first) == {"a": 30, "b": 10}
    # And in every stretch, not just on the whole: each 4 claims hold 3 of a and 1 of b.
    for start in range(0, 40, 4):
        assert tenants(first[start : start + 4]) == {"a": 3, "b": 1}


async def test_a_tenant_arriving_later_gets_its_share_from_its_first_job(
    redis: Redis, queue: str
) -> None:
    jobs = JobQueue(redis, queue)
    await enqueue(jobs, "a", count=50)
    await enqueue(jobs, "b", count=50)
    await claim(redis, queue, 30)

    await enqueue(jobs, "c", count=20)
    nxt = await claim(redis, queue, 3)
    assert tenants(nxt) == {"a": 1, "b": 1, "c": 1}  # one claim round of three equal tenants


async def test_a_tenant_served_alone_keeps_no_debt_and_no_credit(redis: Redis, queue: str) -> None:
    jobs = JobQueue(redis, queue)
    await enqueue(jobs, "a", count=30)
    assert tenants(await claim(redis, queue, 30)) == {"a": 30}  # alone: it gets everything

    await enqueue(jobs, "a", count=10)
    await enqueue(jobs, "b", count=10)
    assert tenants(await claim(redis, queue, 10)) == {"a": 5, "b": 5}


async def test_priority_beats_weight_and_shares_hold_inside_each_class(
    redis: Redis, queue: str
) -> None:
    await publish_tenancy(redis, queue, Tenancy(weights={"nightly": 10}))
    jobs = JobQueue(redis, queue)
    await enqueue(jobs, "nightly", "batch", count=20)
    widget = await enqueue(jobs, "widget", "interactive", count=2)

    taken = await claim(redis, queue, 6)
    assert taken[:2] == widget


async def test_batch_jobs_take_only_the_slots_left_to_them(redis: Redis, queue: str) -> None:
    jobs = JobQueue(redis, queue)
    batch = await enqueue(jobs, "t", "batch", count=5)
    assert await claim(redis, queue, 5, batch_slots=2) == batch[:2]
    interactive = await enqueue(jobs, "t", "interactive", count=2)
    default = await enqueue(jobs, "t", count=1)
    assert await claim(redis, queue, 5, batch_slots=1) == [*interactive, *default, batch[2]]


async def test_a_queued_job_moves_up_one_class_per_aging_time(redis: Redis, queue: str) -> None:
    aging_s = 0.4
    await publish_tenancy(redis, queue, Tenancy(aging_s=aging_s))
    jobs = JobQueue(redis, queue)
    (old,) = await enqueue(jobs, "nightly", "batch")

    await asyncio.sleep(aging_s + 0.1)
    assert await claim(redis, queue, 0) == []  # a claim round moves aged jobs up
    assert (await redis.zscore(queue, old)) // BAND_SPAN == 1
    await asyncio.sleep(aging_s + 0.1)
    await claim(redis, queue, 0)
    assert (await redis.zscore(queue, old)) // BAND_SPAN == 0
    assert await redis.zscore(aging_key(queue), old) is None  # at the top: it ages no further

    # In the interactive class it takes its tenant's share there, beside newer chats: no
    # starvation, and no jump ahead of every chat either.
    fresh = await enqueue(jobs, "widget", "interactive", count=3)
    taken = await claim(redis, queue, 4)
    assert sorted(taken) == sorted([old, *fresh])
    assert taken.index(old) <= 1


async def test_aging_zero_is_strict_priority(redis: Redis, queue: str) -> None:
    await publish_tenancy(redis, queue, Tenancy(aging_s=0))
    jobs = JobQueue(redis, queue)
    (old,) = await enqueue(jobs, "nightly", "batch")
    assert await redis.zcard(aging_key(queue)) == 0
    await asyncio.sleep(0.2)
    await claim(redis, queue, 0)
    assert (await redis.zscore(queue, old)) // BAND_SPAN == 2


async def test_a_tenants_queued_cap_refuses_only_that_tenant_and_frees_on_claim_and_cancel(
    redis: Redis, queue: str
) -> None:
    await publish_tenancy(redis, queue, Tenancy(max_queued={"nightly": 2}))
    jobs = JobQueue(redis, queue)
    first, second = await enqueue(jobs, "nightly", "batch", count=2)

    refused = await jobs.enqueue(
        "nightly-3", REQUEST, deadline_s=60, max_depth=0, tenant="nightly", priority="batch"
    )
    assert refused.outcome is Enqueued.TENANT_FULL and refused.tenant_cap == 2
    assert await redis.zscore(queue, "nightly-3") is None
    await enqueue(jobs, "widget", "interactive", count=5)  # another tenant: not limited
    assert await queued_by_tenant(redis, queue) == {"nightly": 2, "widget": 5}

    await claim(redis, queue, 6)  # the widget's five and one of nightly's
    assert await queued_by_tenant(redis, queue) == {"nightly": 1}
    await enqueue(jobs, "nightly", "batch")
    scores = [await redis.zscore(queue, job_id) for job_id in (first, second)]
    remaining = (first, second)[scores.index(next(s for s in scores if s is not None))]
    await jobs.cancel(EventLog(redis, replay_ttl_s=60), remaining, "test")
    assert await queued_by_tenant(redis, queue) == {"nightly": 1}
    assert not await redis.hexists(tenant_of_key(queue), remaining)


async def test_the_published_rules_read_back(redis: Redis, queue: str) -> None:
    assert await read_tenancy(redis, queue) is None
    rules = Tenancy(weights={"a": 3, "b": 0.5}, max_queued={"b": 100}, default_weight=2, aging_s=30)
    await publish_tenancy(redis, queue, rules)
    assert await read_tenancy(redis, queue) == rules
    await publish_tenancy(redis, queue, Tenancy())  # a restart with fewer rules drops the rest
    assert await read_tenancy(redis, queue) == Tenancy()


@pytest.mark.parametrize("weights", [{"a": 3, "b": 1}, {"a": 1, "b": 1, "c": 2}])
async def test_two_workers_claiming_at_once_take_every_job_once_in_share(
    redis: Redis, queue: str, weights: dict[str, float]
) -> None:
    await publish_tenancy(redis, queue, Tenancy(weights=weights))
    jobs = JobQueue(redis, queue)
    for tenant in weights:
        await enqueue(jobs, tenant, count=60)
    rounds = [
        await asyncio.gather(claim(redis, queue, 4), claim(redis, queue, 4)) for _ in range(5)
    ]
    taken = [job_id for pair in rounds for claimed in pair for job_id in claimed]
    assert len(taken) == len(set(taken)) == 40
    total = sum(weights.values())
    assert tenants(taken) == {tenant: 40 * weight / total for tenant, weight in weights.items()}


async def test_a_tenant_that_cancelled_its_backlog_owes_nothing(redis: Redis, queue: str) -> None:
    jobs = JobQueue(redis, queue)
    log = EventLog(redis, replay_ttl_s=60)
    await enqueue(jobs, "a", count=100)
    for job_id in await enqueue(jobs, "b", count=100):
        await jobs.cancel(log, job_id, "test")
    await enqueue(jobs, "b", count=10)
    assert tenants(await claim(redis, queue, 20)) == {"a": 10, "b": 10}


async def test_the_fair_queuing_state_holds_only_flows_with_work_queued(
    redis: Redis, queue: str
) -> None:
    jobs = JobQueue(redis, queue)
    for tenant in ("a", "b", "c"):
        await enqueue(jobs, tenant, "batch", count=3)
    await claim(redis, queue, 9)
    fields = {field.decode() for field in await redis.hkeys(fair_key(queue))}
    assert fields == {"clock:2"}


async def test_batch_work_aged_into_a_higher_class_still_keeps_off_the_reserved_slots(
    redis: Redis, queue: str
) -> None:
    await publish_tenancy(redis, queue, Tenancy(aging_s=0.2))
    jobs = JobQueue(redis, queue)
    (aged,) = await enqueue(jobs, "nightly", "batch")
    await asyncio.sleep(0.3)
    await claim(redis, queue, 0)
    assert (await redis.zscore(queue, aged)) // BAND_SPAN == 1  # now in the default class
    default = await enqueue(jobs, "team", count=1)
    assert await claim(redis, queue, 2, batch_slots=0) == default
    assert await claim(redis, queue, 2, batch_slots=1) == [aged]
