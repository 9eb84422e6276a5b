"""Liveness by progress (worker/liveness.py) against the real engine: a worker whose engine
processes are frozen while the worker itself runs on stops claiming, says it is stalled, and
ends itself; a healthy worker beside it takes the new chats and continues the frozen one's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from edgeq.core.events import read_events
from edgeq.core.leases import engine_failures, lease_expired
from edgeq.core.protocol import DoneEvent, ErrorEvent, StreamEvent
from edgeq.core.registry import WorkerInfo, live_workers
from edgeq.exit_codes import EXIT_ENGINE_STALLED, EXIT_JOB_FAILED
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import EDGEQ, engine_env, engine_of, suspended

pytestmark = pytest.mark.engine

STALL_S = 3.0
STALL_EXIT_S = 8.0
# Two engines on two cores stall an event loop for seconds at times: a lease this long is not
# mistaken for a death (tests/chaos/test_guarantees.py).
LEASE_TTL_S = 5.0
ANSWER_TOKENS = 24
CHATS = 3
DEADLINE_S = 120.0

T = TypeVar("T")


async def until(check: Callable[[], Awaitable[T | None]], what: str) -> T:
    """The first truthy answer of ``check``, polled until DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if answer := await check():
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {DEADLINE_S:g} s: {what}")


def started_on(worker: WorkerProcess, job_ids: set[str]) -> set[str]:
    """Which of ``job_ids`` the worker started or continued, from its log."""
    return {
        str(event["job_id"])
        for event in worker.log_events()
        if event.get("event") in ("job_started", "job_continued") and event.get("job_id") in job_ids
    }


def logged(worker: WorkerProcess, name: str) -> dict[str, object] | None:
    return next((event for event in worker.log_events() if event.get("event") == name), None)


def assert_one_done(events: list[StreamEvent]) -> DoneEvent:
    assert [event.seq for event in events] == list(range(len(events)))  # no gap, no repeat
    assert sum(isinstance(event, DoneEvent | ErrorEvent) for event in events) == 1, events
    assert isinstance(events[-1], DoneEvent), events[-1]
    return events[-1]


async def read_whole(job) -> list[StreamEvent]:
    return [event async for event in job.stream()]


def metric(worker: WorkerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as page:
        for line in page.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not among the worker's metrics")


async def test_a_worker_whose_engine_froze_stops_claiming_and_its_chats_go_on_elsewhere(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    queue = f"edgeq:test-{uuid.uuid4().hex[:8]}"
    env = engine_env(tiny_model, redis_server.url, queue) | {
        "EDGEQ_LEASE_TTL_S": str(LEASE_TTL_S),
        "EDGEQ_ENGINE_STALL_S": str(STALL_S),
        "EDGEQ_ENGINE_STALL_EXIT_S": str(STALL_EXIT_S),
        "PYTHONUNBUFFERED": "1",  # its log is read live
    }
    stuck = WorkerProcess(env, tmp_path / "stuck.log").start()
    healthy = WorkerProcess(env, tmp_path / "healthy.log").start()
    engine: list[psutil.Process] = []
    try:
        stuck.wait_ready()
        healthy.wait_ready()
        engine = engine_of(stuck)
        async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
            # The stuck worker's engine frozen for good, its worker process left running; the
            # healthy worker held still meanwhile, so the first chats are the stuck one's
            # whatever this machine's speed.
            for process in engine:
                process.suspend()
            with suspended([psutil.Process(healthy.process.pid)]):
                before = [
                    await client.submit(f"before {i}", max_tokens=ANSWER_TOKENS)
                    for i in range(CHATS)
                ]
                before_ids = {job.job_id for job in before}

                async def all_started() -> bool:
                    return started_on(stuck, before_ids) == before_ids

                await until(all_started, "the stuck worker started the first chats")

                async def stalled() -> WorkerInfo | None:
                    workers = await live_workers(client.redis, queue)
                    return next((w for w in workers if w.pid == stuck.process.pid
                                 and w.state == "stalled"), None)  # fmt: skip

                info = await until(stalled, "the stuck worker's heartbeat says stalled")
                assert info.stalled_since is not None
                shown = await asyncio.to_thread(
                    subprocess.run, [*EDGEQ, "status"], env={**os.environ, **env},
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                assert "stalled" in shown.stdout, shown.stdout
                assert metric(stuck, "edgeq:engine_stalls_total") == 1
                event = logged(stuck, "engine_stalled")
                assert event is not None
                # Declared once the engine had held work for the setting with no step.
                assert STALL_S <= float(event["no_step_s"]) < STALL_S + 5  # type: ignore[arg-type]

                # The healthy worker resumes; the stalled one takes none of what comes now.
            after = [
                await client.submit(f"after {i}", max_tokens=ANSWER_TOKENS) for i in range(CHATS)
            ]
            after_events = await asyncio.wait_for(
                asyncio.gather(*(read_whole(job) for job in after)), DEADLINE_S
            )
            for events in after_events:
                assert not assert_one_done(events).continued  # started once, on the healthy one
            after_ids = {job.job_id for job in after}
            assert started_on(healthy, after_ids) == after_ids
            assert not started_on(stuck, after_ids)

            # The stuck worker ends itself, and the healthy one continues its chats to done.
            code = await asyncio.to_thread(stuck.process.wait, DEADLINE_S)
            assert code == EXIT_ENGINE_STALLED, stuck.tail()
            before_events = await asyncio.wait_for(
                asyncio.gather(*(read_whole(job) for job in before)), DEADLINE_S
            )
            for events in before_events:
                assert assert_one_done(events).continued == 1
            for job in before:  # counted before the exit: a second failure would quarantine it
                assert await engine_failures(client.redis, job.job_id) == 1
            assert started_on(healthy, before_ids) == before_ids
            _, alive = await asyncio.to_thread(psutil.wait_procs, engine, 30)
            assert not alive, f"the stalled worker's engine outlived it: {alive}"
            ended = logged(stuck, "worker_ending_stalled")
            assert ended is not None and ended["running"] == CHATS
    finally:
        for process in engine:  # resumed before they are killed: a stopped process hangs on
            try:
                process.resume()
            except psutil.NoSuchProcess:
                pass
        stuck.stop(signal.SIGKILL)
        healthy.stop()


async def test_a_stall_that_ends_before_the_exit_setting_loses_nothing(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    queue = f"edgeq:test-{uuid.uuid4().hex[:8]}"
    env = engine_env(tiny_model, redis_server.url, queue) | {
        "EDGEQ_ENGINE_STALL_S": str(STALL_S),
        "EDGEQ_ENGINE_STALL_EXIT_S": str(DEADLINE_S * 2),  # the test resumes it long before
        "PYTHONUNBUFFERED": "1",
    }
    worker = WorkerProcess(env, tmp_path / "worker.log").start()
    engine: list[psutil.Process] = []
    try:
        worker.wait_ready()
        engine = engine_of(worker)
        async with ChatClient(redis_url=redis_server.url, queue=queue) as client:

            async def in_state(state: str) -> WorkerInfo | None:
                workers = await live_workers(client.redis, queue)
                return next((w for w in workers if w.state == state), None)

            with suspended(engine):
                held = await client.submit("held", max_tokens=ANSWER_TOKENS)
                await until(lambda: in_state("stalled"), "the worker's heartbeat says stalled")
                submitted = time.time()
                queued = await client.submit("queued while stalled", max_tokens=ANSWER_TOKENS)

                async def heard_since() -> WorkerInfo | None:
                    info = await in_state("stalled")
                    return info if info and info.heartbeat_at > submitted else None

                # Its wake came at once; a heartbeat later, the stalled worker still runs one.
                assert (await until(heard_since, "a heartbeat after the submit")).running == 1
                assert not started_on(worker, {queued.job_id})
            # The engine steps again: the worker is ready, takes what waited, and its chats
            # end as if nothing happened (no continuation, one terminal event each).
            await until(lambda: in_state("ready"), "the worker's heartbeat says ready again")
            for job in (held, queued):
                events = await asyncio.wait_for(read_whole(job), DEADLINE_S)
                assert not assert_one_done(events).continued
            assert logged(worker, "engine_recovered") is not None
            assert worker.process.poll() is None
    finally:
        for process in engine:
            try:
                process.resume()
            except psutil.NoSuchProcess:
                pass
        worker.stop()


async def test_a_worker_whose_engine_died_exits_with_a_code_its_supervisor_restarts_on(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    # systemd restarts the worker unit on failure only (Restart=on-failure): a worker that
    # ended with 0 after its engine died stayed down for good. The chat that met the dead
    # engine is not ended: the death is counted on it and its lease let run out, for another
    # worker (or this one restarted) to continue it (tests/test_poison.py).
    queue = f"edgeq:test-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(engine_env(tiny_model, redis_server.url, queue), tmp_path / "w.log")
    try:
        worker.start().wait_ready()
        for process in engine_of(worker):
            process.kill()
        async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
            job = await client.submit("into a dead engine", max_tokens=ANSWER_TOKENS)
            await job.aclose()
            code = await asyncio.to_thread(worker.process.wait, DEADLINE_S)
            assert code == EXIT_JOB_FAILED, worker.tail()
            assert await engine_failures(client.redis, job.job_id) == 1
            assert not [e for e in await read_events(client.redis, job.job_id)
                        if isinstance(e, DoneEvent | ErrorEvent)]  # fmt: skip
            assert await lease_expired(client.redis, queue, job.job_id)  # to be handed over
    finally:
        worker.stop(signal.SIGKILL)
