"""A poison job against the real engine (#41): a request that kills every engine it reaches
(edgeq.testing.engine_poison) costs two engines, then is quarantined: it ends with
`poison_job`, once, its request is in the dead-letter set, the same request is then refused at
the door until an operator drops the entry, and a worker started again serves the next chat."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest

from edgeq.core.errors import PoisonRefused
from edgeq.core.leases import engine_failures
from edgeq.core.protocol import DoneEvent, ErrorEvent, StreamEvent
from edgeq.exit_codes import EXIT_JOB_FAILED
from edgeq.producer.client import ChatClient
from edgeq.testing.engine_poison import POISON_ENV, POISON_SEED
from edgeq.testing.processes import RedisServer, WorkerProcess
from helpers import EDGEQ, engine_env, suspended

pytestmark = pytest.mark.engine

# Two engines on two cores stall an event loop for seconds at times: a lease this long is not
# mistaken for a death (tests/chaos/test_guarantees.py).
LEASE_TTL_S = 5.0
ANSWER_TOKENS = 16
DEADLINE_S = 120.0
POISON_PROMPT = "a request built to kill"


def started_on(worker: WorkerProcess, job_id: str) -> list[str]:
    """How the worker started the job, from its log: job_started, job_continued."""
    return [
        str(event["event"])
        for event in worker.log_events()
        if event.get("event") in ("job_started", "job_continued") and event.get("job_id") == job_id
    ]


async def read_whole(job) -> list[StreamEvent]:
    return [event async for event in job.stream()]


async def test_a_request_that_kills_two_engines_is_quarantined_and_the_box_serves_on(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    queue = f"edgeq:test-{uuid.uuid4().hex[:8]}"
    env = engine_env(tiny_model, redis_server.url, queue) | {
        "EDGEQ_LEASE_TTL_S": str(LEASE_TTL_S),
        POISON_ENV: str(POISON_SEED),
        "PYTHONUNBUFFERED": "1",  # its log is read live
    }
    first = WorkerProcess(env, tmp_path / "first.log").start()
    second = WorkerProcess(env, tmp_path / "second.log").start()
    restarted: WorkerProcess | None = None
    try:
        first.wait_ready()
        second.wait_ready()
        client = ChatClient(redis_url=redis_server.url, queue=queue, stream_timeout_s=DEADLINE_S)
        async with client:
            # The second worker held still: the poison is the first one's, whatever this
            # machine's speed. Its engine dies; the worker counts the death on the job, lets
            # its lease run out and exits 1 (its supervisor restarts it).
            with suspended([psutil.Process(second.process.pid)]):
                poison = await client.submit(
                    POISON_PROMPT, seed=POISON_SEED, max_tokens=ANSWER_TOKENS
                )
                code = await asyncio.to_thread(first.process.wait, DEADLINE_S)
                assert code == EXIT_JOB_FAILED, first.tail()
                assert await engine_failures(client.redis, poison.job_id) == 1
            # Continued on the second worker, it kills that engine too: the second failure
            # quarantines it instead of a third engine.
            events = await asyncio.wait_for(read_whole(poison), DEADLINE_S)
            assert [event.seq for event in events] == list(range(len(events)))
            assert sum(isinstance(event, DoneEvent | ErrorEvent) for event in events) == 1
            ending = events[-1]
            assert isinstance(ending, ErrorEvent) and ending.code == "poison_job", ending
            assert "2 engines" in ending.message
            assert started_on(first, poison.job_id) == ["job_started"]
            assert started_on(second, poison.job_id) == ["job_continued"]
            code = await asyncio.to_thread(second.process.wait, DEADLINE_S)
            assert code == EXIT_JOB_FAILED, second.tail()

            listed = await asyncio.to_thread(
                subprocess.run, [*EDGEQ, "dead-letter", "list"], env={**os.environ, **env},
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            assert poison.job_id in listed.stdout and "engine_failures=2" in listed.stdout

            # Sent again unchanged, it is refused at the door (no engine would survive it)...
            with pytest.raises(PoisonRefused) as refused:
                await client.submit(POISON_PROMPT, seed=POISON_SEED, max_tokens=ANSWER_TOKENS)
            assert refused.value.job_id == poison.job_id
            # ...until an operator drops the entry: then it is accepted (and cancelled here,
            # before a worker that would die of it is started again).
            await asyncio.to_thread(
                subprocess.run, [*EDGEQ, "dead-letter", "drop", poison.job_id],
                env={**os.environ, **env}, capture_output=True, text=True, check=True,
            )  # fmt: skip
            again = await client.submit(POISON_PROMPT, seed=POISON_SEED, max_tokens=ANSWER_TOKENS)
            assert await again.cancel("not sent to an engine in this test")
            await again.aclose()

            # A worker started again (as systemd would) serves the next chat.
            restarted = WorkerProcess(env, tmp_path / "restarted.log").start()
            # Off the event loop: the client's pub/sub reader must not sit blocked for an
            # engine start (its health check and the next subscribe then raced on one socket).
            await asyncio.to_thread(restarted.wait_ready)
            healthy = await client.submit("a healthy chat", max_tokens=ANSWER_TOKENS)
            events = await asyncio.wait_for(read_whole(healthy), DEADLINE_S)
            assert isinstance(events[-1], DoneEvent), events[-1]
            assert sum(isinstance(event, DoneEvent | ErrorEvent) for event in events) == 1
            assert not started_on(restarted, poison.job_id)  # never a third engine
    finally:
        for worker in (first, second, restarted):
            if worker is not None:
                worker.stop(signal.SIGKILL)
