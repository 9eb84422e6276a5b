"""OpenAI's Batch API end to end: the official SDK uploads a file and creates a batch on a real
gateway, the session's worker runs its lines on the real engine, and the output file has every
custom_id exactly once, even when the gateway running the batch is killed mid-batch.
(Refusals, tenants, cancel and expiry without an engine: tests/test_batch_files.py.)"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from redis import Redis as SyncRedis

from edgeq.core.keys import events_key, leases_key
from edgeq.producer.client import ChatClient
from edgeq.resources.batches.runner import line_job_id
from edgeq.testing.engine_hold import EngineHold
from edgeq.testing.processes import GatewayProcess, WorkerProcess, stop_process
from helpers import EDGEQ, slowed

pytestmark = pytest.mark.engine

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


def line(custom_id: str, model: str, max_tokens: int = 16, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Say something about {custom_id}."}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def gateway_env(worker: WorkerProcess, **settings: str) -> dict[str, str]:
    names = ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")
    return {**{name: worker.env[name] for name in names}, **settings}


@pytest.fixture
def gateway(worker: WorkerProcess, tmp_path: Path) -> Iterator[str]:
    # Not shared with the other tests: a gateway left running would take over their batches.
    process = GatewayProcess(gateway_env(worker), tmp_path / "gateway.log").start()
    yield process.base_url
    process.stop()


def create_batch(sdk: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    content = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    file = sdk.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress", batch.errors
    return batch.id


def wait_until(sdk: openai.OpenAI, batch_id: str, done: Any, timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert batch.status in ("in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.request_counts}"
        time.sleep(0.25)


def output_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(text) for text in sdk.files.content(file_id).text.splitlines()]


def test_a_batch_through_the_official_sdk(gateway: str, worker: WorkerProcess) -> None:
    model = worker.env["EDGEQ_MODEL"]
    sdk = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0)
    lines = [line(f"req-{n}", model) for n in range(6)]
    lines.append(line("schema", model, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA},
    }))  # fmt: skip
    batch_id = create_batch(sdk, lines)
    batch = wait_until(sdk, batch_id, lambda batch: batch.status == "completed", 120)
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (7, 7)
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.completed_at is not None and batch.finalizing_at is not None
    output = output_of(sdk, batch.output_file_id)
    assert sorted(item["custom_id"] for item in output) == sorted(i["custom_id"] for i in lines)
    for item in output:
        assert item["error"] is None and item["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(item["response"]["body"])
        assert completion.choices[0].message.role == "assistant"
        assert completion.usage is not None and completion.usage.completion_tokens > 0
    (answer,) = [item for item in output if item["custom_id"] == "schema"]
    parsed = json.loads(answer["response"]["body"]["choices"][0]["message"]["content"])
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str)
    # Lines are not streamed: each job stored its answer as one delta (none for an empty
    # answer) and its done event.
    redis = SyncRedis.from_url(worker.env["EDGEQ_REDIS_URL"])
    stored = [
        [json.loads(fields[b"event"])["type"] for _, fields in redis.xrange(events_key(job_id))]
        for job_id in (item["response"]["request_id"] for item in output)
    ]
    assert all(types in (["delta", "done"], ["done"]) for types in stored), stored
    assert stored.count(["delta", "done"]) >= len(lines) - 1


def test_a_killed_gateways_batch_is_finished_by_another(
    worker: WorkerProcess, worker_hold: EngineHold, tmp_path: Path
) -> None:
    """SIGKILL the gateway running a batch: a gateway started after it takes the batch over
    when the lease runs out, attaches to the lines already queued or running, and the output
    has every custom_id exactly once."""
    env = gateway_env(worker, EDGEQ_GATEWAY_BATCH_WINDOW="2", EDGEQ_GATEWAY_BATCH_LEASE_S="2")
    first = GatewayProcess(env, tmp_path / "first.log").start()
    try:
        sdk = openai.OpenAI(base_url=first.base_url, api_key="unused", max_retries=0)
        model = worker.env["EDGEQ_MODEL"]
        # The first three lines end within 8 tokens; the engine stops once a line has 9. So
        # three lines are done and the rest wait or run when the gateway dies, however fast
        # this machine is (unheld, a fast run could end all 24 before the kill).
        lines = [line(f"k-{n}", model, max_tokens=8 if n < 3 else 48) for n in range(24)]
        worker_hold.arm(after_tokens=9)
        batch_id = create_batch(sdk, lines)
        wait_until(sdk, batch_id, lambda b: b.request_counts.completed >= 3, 120)
        assert first.process is not None
        stop_process(first.process, signal.SIGKILL)
    finally:
        first.stop()
    second = GatewayProcess(env, tmp_path / "second.log").start()
    try:
        sdk = openai.OpenAI(base_url=second.base_url, api_key="unused", max_retries=0)
        assert sdk.batches.retrieve(batch_id).request_counts.completed < len(lines)
        worker_hold.release()
        batch = wait_until(sdk, batch_id, lambda batch: batch.status == "completed", 180)
        output = output_of(sdk, batch.output_file_id)
        ids = [item["custom_id"] for item in output]
        assert sorted(ids) == sorted(item["custom_id"] for item in lines)  # each exactly once
        assert batch.request_counts.completed == len(lines) and batch.error_file_id is None
        assert "batch_running" in second.log_path.read_text()
    finally:
        second.stop()


def test_edgeq_batch_submit_wait_runs_without_a_gateway(
    worker: WorkerProcess, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """``edgeq batch submit --wait`` runs the batch itself (no gateway is running) with a
    progress line, and ``edgeq batch results`` prints every custom_id once."""
    model = worker.env["EDGEQ_MODEL"]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line(f"cli-{n}", model)) + "\n" for n in range(5)))
    submit = subprocess.run(
        [*EDGEQ, "batch", "submit", str(path), "--wait"],
        env=cli_env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    batch_id = submit.stdout.strip()
    assert batch_id.startswith("batch_")
    assert "completed: 5 completed, 0 failed of 5" in submit.stderr
    results = subprocess.run(
        [*EDGEQ, "batch", "results", batch_id],
        env=cli_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert results.returncode == 0, results.stderr
    ids = sorted(json.loads(text)["custom_id"] for text in results.stdout.splitlines())
    assert ids == [f"cli-{n}" for n in range(5)]


async def test_a_chat_sent_while_a_batch_runs_starts_before_its_queued_lines(
    worker: WorkerProcess, client: ChatClient, tmp_path: Path
) -> None:
    """The batch's lines are jobs of the batch class: an interactive chat sent while lines
    wait in the queue is started (the worker's log, in order) before every one of them."""
    env = gateway_env(worker, EDGEQ_GATEWAY_BATCH_WINDOW="300")
    process = GatewayProcess(env, tmp_path / "gateway.log").start()
    try:
        sdk = openai.OpenAI(base_url=process.base_url, api_key="unused", max_retries=0)
        model = worker.env["EDGEQ_MODEL"]
        # The engine held to a sliver of a CPU while the chat comes: the lines run long, so
        # many still wait in the queue however fast this machine is (unslowed, a fast run had
        # ended or started every line before the chat was sent).
        with slowed(worker):
            batch_id = create_batch(sdk, [line(f"p-{n}", model, max_tokens=64) for n in range(300)])
            await asyncio.to_thread(
                wait_until, sdk, batch_id, lambda b: b.request_counts.completed >= 1, 120
            )
            job = await client.submit("Quick question", max_tokens=4, priority="interactive")
            queue = worker.env["EDGEQ_QUEUE"]
            # One snapshot: a line that ended between two separate reads was in the queue of the
            # first and gone from the leases of the second, and counted as waiting (a CI run).
            async with client.redis.pipeline(transaction=True) as snapshot:
                snapshot.zrange(queue, 0, -1)
                snapshot.zrange(leases_key(queue), 0, -1)
                queued_raw, running_raw = await snapshot.execute()
            queued = {raw.decode() for raw in queued_raw}
            running = {raw.decode() for raw in running_raw}
            # This batch's lines only: a job an earlier test left in the shared queue is no line.
            lines = {line_job_id(queue, batch_id, n, 0) for n in range(300)}
            waiting = (queued - running) & lines
            assert waiting, "no batch line was waiting in the queue: the test shows nothing"
        await job.result()
        await asyncio.to_thread(wait_until, sdk, batch_id, lambda b: b.status == "completed", 240)
        started = [
            json.loads(text)["job_id"]
            for text in worker.log_path.read_text().splitlines()
            if '"job_started"' in text
        ]
        chat_at = started.index(job.job_id)
        at = {job_id: started.index(job_id) for job_id in waiting if job_id in started}
        before = sorted(index for index in at.values() if index < chat_at)
        assert not before, f"lines waiting when the chat came started before it: {before, chat_at}"
    finally:
        process.stop()


def test_batches_of_two_tenants_never_get_a_third_tenants_chat_refused(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    """Two tenants' batches keep more lines queued or running than EDGEQ_MAX_QUEUE (their own
    budget, EDGEQ_GATEWAY_BATCH_QUEUED_MAX); a third tenant's chats are admitted and answered
    while they run, and the batches still complete."""
    keys = {"acme": "sk-acme", "other": "sk-other", "third": "sk-third"}
    env = gateway_env(
        worker,
        EDGEQ_MAX_QUEUE="4",
        EDGEQ_GATEWAY_BATCH_WINDOW="4",
        EDGEQ_GATEWAY_BATCH_QUEUED_MAX="8",
        EDGEQ_GATEWAY_TENANT_KEYS=",".join(f"{t}={k}" for t, k in keys.items()),
    )
    process = GatewayProcess(env, tmp_path / "gateway.log").start()
    try:
        model = worker.env["EDGEQ_MODEL"]

        def sdk(tenant: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=process.base_url, api_key=keys[tenant], max_retries=0)

        batches = [
            (sdk(tenant), create_batch(sdk(tenant), [
                line(f"{tenant}-{n}", model, max_tokens=96) for n in range(24)
            ]))
            for tenant in ("acme", "other")
        ]  # fmt: skip
        redis = SyncRedis.from_url(worker.env["EDGEQ_REDIS_URL"])
        deadline = time.monotonic() + 60
        while redis.zcard(worker.env["EDGEQ_QUEUE"]) < 4:  # the batches alone fill the limit
            assert time.monotonic() < deadline, "the batches never held EDGEQ_MAX_QUEUE lines"
            time.sleep(0.02)
        third = sdk("third")
        for n in range(3):
            answer = third.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Hello {n}"}], max_tokens=8
            )
            assert answer.choices[0].message.role == "assistant"
        for client, batch_id in batches:
            done = wait_until(client, batch_id, lambda batch: batch.status == "completed", 300)
            assert done.request_counts is not None and done.request_counts.completed == 24
    finally:
        process.stop()
