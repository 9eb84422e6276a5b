"""Helpers shared by the tests: how a client in another language would use the wire contract."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from producer.protocol import JOB_FUNCTION, stream_channel

# The tiny model's context in tests, kept short so "prompt too long" is cheap to provoke.
TEST_MAX_MODEL_LEN = 512
# A small step budget, so that ordinary prompts in the tests are prefilled in several chunks.
TEST_MAX_NUM_BATCHED_TOKENS = 128
EDGEQ = [sys.executable, "-m", "producer.cli"]
TERMINAL_TYPES = {"done", "error"}
# Figures measured by the chaos tests, printed at the end of the run.
FIGURES: dict[str, object] = {}


def engine_env(model: Path, redis_url: str, queue: str) -> dict[str, str]:
    """Settings for a worker on the tiny model, sized for a 2-core test machine."""
    return {
        "EDGEQ_REDIS_URL": redis_url,
        "EDGEQ_QUEUE": queue,
        "EDGEQ_MODEL": str(model),
        "EDGEQ_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "EDGEQ_MAX_NUM_BATCHED_TOKENS": str(TEST_MAX_NUM_BATCHED_TOKENS),
        "EDGEQ_CPU_KV_CACHE_GIB": "1",
        "HF_HUB_OFFLINE": "1",
    }


def arq_job_bytes(request: Any) -> bytes:
    """A chat job exactly as README's wire contract spells it for other languages."""
    job = {"f": JOB_FUNCTION, "a": [request], "k": {}, "t": 1, "et": int(time.time() * 1000)}
    return json.dumps(job).encode()


async def enqueue_raw(redis: Redis, queue: str, payload: bytes, job_id: str | None = None) -> str:
    """Enqueue with plain Redis commands (no arq client): SET the job, ZADD its id."""
    job_id = job_id or uuid.uuid4().hex
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(f"arq:job:{job_id}", payload, px=60_000)
        pipe.zadd(queue, {job_id: int(time.time() * 1000)})
        await pipe.execute()
    return job_id


async def run_raw_job(
    redis: Redis, queue: str, payload: bytes, timeout_s: float = 60
) -> list[dict[str, Any]]:
    """Subscribe (and wait for the confirmation), enqueue a raw payload, collect its events."""
    job_id = uuid.uuid4().hex
    pubsub = redis.pubsub()
    await pubsub.subscribe(stream_channel(job_id))
    confirmation = await pubsub.get_message(timeout=5)
    assert confirmation is not None and confirmation["type"] == "subscribe"
    await enqueue_raw(redis, queue, payload, job_id)
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not events or events[-1]["type"] not in TERMINAL_TYPES:
            assert time.monotonic() < deadline, f"no terminal event for {job_id}: {events}"
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                events.append(json.loads(message["data"]))
    finally:
        await pubsub.aclose()
    assert all(event["job_id"] == job_id for event in events)
    return events
