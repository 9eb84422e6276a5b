"""A background response's stream survives a worker SIGKILLed mid-answer (another worker
continues the job) and a Redis restart (append-only file) mid-answer: resumed with
``starting_after``, the stream is gap-free, its text is the stored output, and the response
ends ``incomplete`` (it ran its whole max_output_tokens). Own Redis, two own workers, one
gateway: the one test here that starts engines of its own."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from redis import Redis as SyncRedis

from edgeq.core.keys import events_key
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from helpers import FULL_LENGTH_SEEDS, engine_env, ready_worker, slowed

pytestmark = pytest.mark.engine

QUEUE = "edgeq:responses-faults"
LONG = 300


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker process stopped (SIGSTOP) for the block: it claims nothing meanwhile."""
    assert worker.process is not None
    process = psutil.Process(worker.process.pid)
    process.suspend()
    try:
        yield
    finally:
        process.resume()


def read_until(stream: Any, count: int) -> list[Any]:
    events = []
    for event in stream:
        events.append(event)
        if len(events) == count:
            break
    return events


def resumed(sdk: openai.OpenAI, seen: list[Any]) -> list[Any]:
    """The rest of the stream after ``seen``, resumed as often as the connection breaks."""
    events = list(seen)
    deadline = time.monotonic() + 120
    while events[-1].type not in ("response.completed", "response.incomplete", "response.failed"):
        assert time.monotonic() < deadline, "the stream did not end"
        try:
            stream = sdk.responses.retrieve(
                events[0].response.id, stream=True, starting_after=events[-1].sequence_number
            )
            for event in stream:
                events.append(event)
        except (openai.APIError, openai.APIConnectionError):
            time.sleep(0.5)  # Redis or the gateway still away: resume again
    return events


def assert_whole(sdk: openai.OpenAI, events: list[Any]) -> Any:
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(numbers))), numbers
    final = sdk.responses.retrieve(events[0].response.id)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert text == final.output_text and final.usage.output_tokens == LONG
    return final


def start_stream(sdk: openai.OpenAI, model: str, seed: int) -> Any:
    return sdk.responses.create(
        model=model,
        input="Tell a long story.",
        max_output_tokens=LONG,
        background=True,
        stream=True,
        extra_body={"seed": seed},
    )


def test_a_stream_resumes_after_a_worker_sigkill_and_a_redis_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    redis_server = RedisServer(extra_args=("--appendonly", "yes", "--dir", str(tmp_path))).start()
    env = engine_env(tiny_model, redis_server.url, QUEUE) | {"EDGEQ_LEASE_TTL_S": "3"}
    gateway_env = {name: env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")}
    gateway = GatewayProcess(gateway_env, tmp_path / "gateway.log")
    try:
        with (
            ready_worker(env, tmp_path / "a.log") as first,
            ready_worker(env, tmp_path / "b.log") as second,
        ):
            gateway.start()
            sdk = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
            model = env["EDGEQ_MODEL"]

            # A worker SIGKILLed mid-answer: the other continues the job.
            with slowed(first, second):
                with paused(second):  # the first worker takes it
                    seen = read_until(start_stream(sdk, model, FULL_LENGTH_SEEDS[0]), 8)
                assert seen[-1].type == "response.output_text.delta"
                first.stop(signal.SIGKILL)
                final = assert_whole(sdk, resumed(sdk, seen))
            raw = SyncRedis.from_url(redis_server.url).xrevrange(
                events_key(final.id.removeprefix("resp_")), count=1
            )
            assert json.loads(raw[0][1][b"event"])["continued"] == 1

            # Redis restarted mid-answer (its append-only file keeps the events).
            with slowed(second):
                seen = read_until(start_stream(sdk, model, FULL_LENGTH_SEEDS[1]), 8)
                assert seen[-1].type == "response.output_text.delta"
                redis_server.stop()
                time.sleep(1.0)
                redis_server.start()
                assert_whole(sdk, resumed(sdk, seen))
    finally:
        gateway.stop()
        redis_server.stop()
