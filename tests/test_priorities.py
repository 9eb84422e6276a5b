"""Priority classes and tenants through a real worker and engine: who starts first, shares by
weight, caps that refuse one tenant only, and what the metrics and ``edgeq status`` show.

The worker runs two jobs at once and keeps one free slot for interactive chats, so a queue
builds up behind it and the order of starts is what the claim chose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from edgeq import ChatClient, ChatJob, JobFailed, QueueFull
from edgeq.core.keys import leases_key
from edgeq.core.scheduling import queued_by_tenant
from edgeq.producer.status import read_status, render_status
from edgeq.testing.processes import RedisServer, WorkerProcess
from tests.helpers import FULL_LENGTH_SEEDS, engine_env, frozen, ready_worker

pytestmark = pytest.mark.engine

QUEUE = "edgeq:test-priorities"
LEASES = leases_key(QUEUE)
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def priority_worker(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    env = engine_env(tiny_model, redis_server.url, QUEUE) | {
        "EDGEQ_MAX_JOBS": "2",
        "EDGEQ_RESERVED_SLOTS": "1",
        "EDGEQ_TENANT_WEIGHTS": "a=3,b=1",
        "EDGEQ_TENANT_MAX_QUEUED": "capped=2",
        "EDGEQ_PRIORITY_AGING_S": "0",  # strict: these tests look at order, not at aging
        # A heartbeat (running counts for `edgeq status`) every 0.25 s: more than once while
        # the occupying chats run, which took 0.44 s for 300 tokens on a fast day.
        "EDGEQ_LEASE_TTL_S": "1",
    }
    with ready_worker(env, tmp_path_factory.mktemp("priorities") / "worker.log") as process:
        yield process


@pytest.fixture
async def client(priority_worker: WorkerProcess) -> AsyncIterator[ChatClient]:
    async with ChatClient(
        redis_url=priority_worker.env["EDGEQ_REDIS_URL"], queue=QUEUE, max_queue=0
    ) as client:
        yield client


@asynccontextmanager
async def occupied(
    client: ChatClient, worker: WorkerProcess, count: int
) -> AsyncIterator[list[asyncio.Task[None]]]:
    """``count`` long interactive chats hold the worker's slots while the block runs. The
    engine is frozen from before they are sent until the block ends, so none of them can end
    however fast this machine is (on a fast one 300 tokens took under half a second, and an
    occupying chat could end while the test was still queueing its backlog); the worker
    still claims and starts them. Yields their readers, which end after the block."""

    async def read_to_the_end(job: ChatJob) -> None:
        async for _ in job.stream():
            pass

    with frozen(worker):
        jobs = [
            await client.submit(MESSAGES, priority="interactive", seed=seed, max_tokens=300)
            for seed in FULL_LENGTH_SEEDS[:count]
        ]
        readers = [asyncio.create_task(read_to_the_end(job)) for job in jobs]
        async with asyncio.timeout(30):  # each holds a lease once its worker has started it
            while None in [await client.redis.zscore(LEASES, job.job_id) for job in jobs]:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        yield readers


async def submit_timed(client: ChatClient, **fields: object) -> tuple[ChatJob, float]:
    """A job and (about) when it was enqueued, to turn its queued_ms into a start time."""
    job = await client.submit(MESSAGES, max_tokens=4, **fields)
    return job, time.time()


async def start_times(submitted: list[tuple[ChatJob, float]]) -> list[float]:
    results = await asyncio.gather(*(job.result() for job, _ in submitted))
    return [
        enqueued + result.timings.queued_ms / 1000
        for (_, enqueued), result in zip(submitted, results, strict=True)
    ]


async def submit_all(client: ChatClient, jobs: dict[str, dict[str, object]]) -> dict[str, ChatJob]:
    """Submit all of ``jobs`` (name -> submit fields), in order."""
    return {
        name: await client.submit(MESSAGES, max_tokens=4, **fields) for name, fields in jobs.items()
    }


async def start_order(worker: WorkerProcess, submitted: dict[str, ChatJob]) -> list[str]:
    """Wait for every answer and return the names in the order the worker started the jobs
    (its job_started log lines: claim order)."""
    await asyncio.gather(*(job.result() for job in submitted.values()))
    names = {job.job_id: name for name, job in submitted.items()}
    return [
        names[str(event["job_id"])]
        for event in worker.log_events()
        if event.get("event") == "job_started" and event.get("job_id") in names
    ]


async def test_interactive_chats_start_before_the_batch_work_queued_ahead_of_them(
    client: ChatClient, priority_worker: WorkerProcess
) -> None:
    async with occupied(client, priority_worker, 1) as running:  # one slot free: interactive
        batch = [await submit_timed(client, priority="batch", tenant="b") for _ in range(6)]
        interactive = [await submit_timed(client, priority="interactive") for _ in range(2)]

    started = await start_times([*batch, *interactive])
    await asyncio.gather(*running)
    # Queued after all six, started before every one of them: through the interactive slot,
    # while the batch jobs wait for the running chat to end.
    assert max(started[6:]) < min(started[:6])


async def test_tenants_with_work_queued_start_by_weight(
    client: ChatClient, priority_worker: WorkerProcess
) -> None:
    async with occupied(client, priority_worker, 2) as running:  # the backlog queues up
        submitted = await submit_all(
            client,
            {
                **{f"a{n}": {"tenant": "a"} for n in range(12)},
                **{f"b{n}": {"tenant": "b"} for n in range(12)},
            },
        )
    order = await start_order(priority_worker, submitted)
    await asyncio.gather(*running)
    assert len(order) == 24
    assert sum(name.startswith("a") for name in order[:8]) == 6, order  # weights 3 : 1


async def test_a_capped_tenant_is_refused_while_others_are_not(
    client: ChatClient, priority_worker: WorkerProcess
) -> None:
    async with occupied(client, priority_worker, 2) as running:
        held = [await client.submit(MESSAGES, tenant="capped", max_tokens=4) for _ in range(2)]
        with pytest.raises(QueueFull, match=r"tenant capped already has 2 jobs queued"):
            await client.submit(MESSAGES, tenant="capped", max_tokens=4)
        # Its batch work is admitted against all its queued jobs (and refused), but never
        # counts against its chats (tests/test_tenant_limits.py).
        with pytest.raises(QueueFull, match=r"tenant capped already has 2 jobs queued"):
            await client.submit(MESSAGES, tenant="capped", priority="batch", max_tokens=4)
        other = await client.submit(MESSAGES, tenant="a", max_tokens=4)

        # Running counts come with the worker's heartbeat (every quarter lease): wait for one.
        deadline = time.monotonic() + 30  # a heartbeat late on a loaded machine, not lost
        while True:
            status = await read_status(client.redis, client.settings)
            rows = {tenant.tenant: tenant for tenant in status.tenants}
            serving = rows.get("default") is not None and rows["default"].running == 2
            if serving or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert rows["default"].running == 2, rows
        assert rows["capped"].queued == 2 and rows["capped"].max_queued == 2
        assert rows["a"].weight == 3 and rows["a"].queued == 1
        shown = render_status(status)
        assert "capped" in shown and "priority aging: off (strict priority)" in shown

    for job in [*held, other]:
        assert (await job.result()).finish_reason in {"stop", "length"}
    await asyncio.gather(*running)
    # Claimed, the capped tenant's jobs no longer count: it may queue again.
    await (await client.submit(MESSAGES, tenant="capped", max_tokens=4)).result()


async def test_the_worker_labels_queue_time_and_ttft_by_class_and_tenant(
    client: ChatClient, priority_worker: WorkerProcess
) -> None:
    await (await client.submit(MESSAGES, priority="batch", tenant="b", max_tokens=4)).result()
    await (await client.submit(MESSAGES, tenant="stranger", max_tokens=4)).result()
    async with httpx.AsyncClient() as http:
        url = f"http://127.0.0.1:{priority_worker.metrics_port}/metrics"
        page = (await http.get(url, timeout=10)).text
    assert 'edgeq:request_queue_time_seconds_count{priority="batch",tenant="b"}' in page
    assert 'edgeq:time_to_first_token_seconds_count{priority="batch",tenant="b"}' in page
    # A tenant the settings do not name: one bounded label for all of them.
    assert 'edgeq:request_queue_time_seconds_count{priority="default",tenant="other"}' in page
    assert 'edgeq:tenant_requests_waiting{tenant="capped"}' in page


async def test_cancel_and_deadline_end_a_queued_batch_job_as_for_any_other(
    client: ChatClient, priority_worker: WorkerProcess
) -> None:
    async with occupied(client, priority_worker, 2) as running:
        cancelled = await client.submit(MESSAGES, priority="batch", tenant="capped", max_tokens=4)
        late = await client.submit(
            MESSAGES, priority="batch", tenant="capped", max_tokens=4, deadline_s=0.1
        )
        assert await cancelled.cancel()
        assert await queued_by_tenant(client.redis, QUEUE) == {"capped": 1}  # the cancel counted
        with pytest.raises(JobFailed) as failure:
            await cancelled.result()
        assert failure.value.code == "cancelled"
        await asyncio.sleep(0.2)  # late's deadline passes while no slot is free

    await asyncio.gather(*running)
    with pytest.raises(JobFailed) as failure:
        await late.result()
    assert failure.value.code == "expired"
    assert await queued_by_tenant(client.redis, QUEUE) == {}
