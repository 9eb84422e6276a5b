"""`edgeq gateway` driven by clients we did not write: the official OpenAI SDK and LangChain's
ChatOpenAI (the seed's own code), against a real gateway process in front of the real worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from edgeq.bench.runners import ModeKind, ModePlan, run_plan
from edgeq.bench.workload import WorkloadSpec, build_workload, load_tokenizer
from edgeq.core.errors import StreamClosed
from edgeq.core.keys import job_key, tenant_of_key
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, StreamEvent, Timings, Usage
from edgeq.core.registry import WorkerInfo, publish_heartbeat, remove_worker
from edgeq.core.scheduling import BAND_SPAN
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import (
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    free_port,
    stop_process,
    wait_for_port,
)
from helpers import EDGEQ, FIGURES, FULL_LENGTH_SEEDS, slowed

pytestmark = pytest.mark.engine

UNSERVED_QUEUE = "edgeq:gateway-unserved"  # no worker: its jobs wait until cancelled
API_KEY = "sk-test-edgeq"
# A tenant key ending in base64 padding: EDGEQ_GATEWAY_TENANT_KEYS splits at the first "=".
TENANT_KEY = "c2stbmlnaHRseQ=="
GATEWAY_TENANT = "gateway-own"  # the unserved gateway's EDGEQ_TENANT
LONG = 300  # tokens; with a FULL_LENGTH_SEEDS seed the answer is still running after a chunk


@pytest.fixture(scope="module")
def gateway_process(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway in front of the session's worker."""
    env = {
        **{name: worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")},
        "EDGEQ_GATEWAY_MODEL_ALIASES": "Qwen-0.6B",
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("gateway") / "gateway.log").start()
    yield process
    process.stop()


@pytest.fixture
def gateway(gateway_process: GatewayProcess) -> str:
    """The OpenAI base URL of the gateway in front of the session's worker."""
    return gateway_process.base_url


@pytest.fixture(scope="module")
def unserved_gateway_process(
    redis_server: RedisServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway with API keys on a queue no worker serves, holding at most one job: plain
    keys, and one that fixes the tenant "nightly"."""
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": UNSERVED_QUEUE,
        "EDGEQ_MODEL": str(tiny_model),
        "EDGEQ_MAX_QUEUE": "1",
        "EDGEQ_GATEWAY_API_KEYS": f"other-key, {API_KEY}",
        "EDGEQ_GATEWAY_TENANT_KEYS": f"nightly={TENANT_KEY}, reports=sk-reports",
        "EDGEQ_GATEWAY_RETRY_AFTER_S": "3",
        "EDGEQ_TENANT": GATEWAY_TENANT,
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("gateway") / "unserved.log").start()
    yield process
    process.stop()


@pytest.fixture
def unserved_gateway(unserved_gateway_process: GatewayProcess) -> str:
    """The OpenAI base URL of the gateway on the queue no worker serves."""
    return unserved_gateway_process.base_url


@pytest.fixture
async def sdk(gateway: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway, api_key="EMPTY", max_retries=0) as client:
        yield client


@pytest.fixture
async def unserved_client(redis_server: RedisServer) -> AsyncIterator[ChatClient]:
    """A client of the unserved queue; a job a failed test left queued is cancelled after it,
    so the next test finds the queue's one place free."""
    async with ChatClient(redis_url=redis_server.url, queue=UNSERVED_QUEUE) as client:
        yield client
        for job_id in await client.redis.zrange(UNSERVED_QUEUE, 0, -1):
            await client.cancel(job_id.decode(), "left queued by a failed test")


async def queued_job_ids(client: ChatClient, *, at_least: int = 1) -> list[str]:
    """The ids in the queue once it holds ``at_least`` jobs (a job takes a moment to arrive)."""
    async with asyncio.timeout(10):
        while True:  # polling Redis: there is no event to wait on
            ids = await client.redis.zrange(client.queue.name, 0, -1)
            if len(ids) >= at_least:
                return [raw.decode() for raw in ids]
            await asyncio.sleep(0.02)


async def open_played_stream(
    sdk: openai.AsyncOpenAI, model: str, client: ChatClient, first_text: str
) -> tuple[str, openai.AsyncStream[ChatCompletionChunk]]:
    """Open a streaming chat through a gateway on a queue no worker serves, and play the
    worker's first delta by hand; returns once the SDK has received it."""
    request = asyncio.create_task(
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    (job_id,) = await queued_job_ids(client)
    await client.events.append(DeltaEvent(job_id=job_id, seq=0, text=first_text))
    stream = await request
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content == first_text:
            break
    return job_id, stream


async def terminal_event(client: ChatClient, job_id: str, timeout_s: float = 10.0) -> object:
    job = await client.attach(job_id)
    events: list[StreamEvent] = []
    try:
        async with asyncio.timeout(timeout_s):
            events += [event async for event in job.stream()]
    except TimeoutError:
        queued = await client.redis.zscore(client.queue.name, job_id) is not None
        raise AssertionError(
            f"job {job_id} did not end within {timeout_s:g} s "
            f"(still queued: {queued}; its events: {events})"
        ) from None
    return events[-1]


async def test_a_non_streaming_chat_returns_the_same_answer_as_chat_client(
    sdk: openai.AsyncOpenAI, client: ChatClient, worker: WorkerProcess
) -> None:
    model = worker.env["EDGEQ_MODEL"]
    raw = await sdk.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=24,
        seed=FULL_LENGTH_SEEDS[0],
        temperature=0.7,
    )
    completion = raw.parse()
    direct = await client.chat("Say something.", max_tokens=24, seed=FULL_LENGTH_SEEDS[0],
                               temperature=0.7)  # fmt: skip

    assert completion.choices[0].message.content == direct.text
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == direct.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == direct.usage.completion_tokens == 24
    assert completion.usage.prompt_tokens == direct.usage.prompt_tokens
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 24
    assert completion.model == model
    job_id = raw.headers["x-edgeq-job-id"]
    assert completion.id == f"chatcmpl-{job_id}"


async def test_a_streaming_chat_sends_chunks_then_finish_then_usage(
    sdk: openai.AsyncOpenAI, client: ChatClient, worker: WorkerProcess
) -> None:
    stream = await sdk.chat.completions.create(
        model=worker.env["EDGEQ_MODEL"],
        messages=[{"role": "user", "content": "Stream something."}],
        max_tokens=40,
        seed=FULL_LENGTH_SEEDS[1],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    direct = await client.chat("Stream something.", max_tokens=40, seed=FULL_LENGTH_SEEDS[1])

    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2, "the answer came in one piece: nothing was streamed"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40
    assert len({chunk.id for chunk in chunks}) == 1


async def test_extra_body_turns_thinking_off_like_chat_template_kwargs(
    sdk: openai.AsyncOpenAI, client: ChatClient, worker: WorkerProcess
) -> None:
    """Qwen3's template renders a different prompt with thinking on and off, so the prompt's
    token count shows which one the worker used."""

    async def prompt_tokens(**extra: object) -> int:
        completion = await sdk.chat.completions.create(
            model=worker.env["EDGEQ_MODEL"],
            messages=[{"role": "user", "content": "Think?"}],
            max_tokens=2,
            extra_body=extra,
        )
        assert completion.usage is not None
        return completion.usage.prompt_tokens

    off = await prompt_tokens(enable_thinking=False, return_reasoning=False)
    on = await prompt_tokens(enable_thinking=True)
    via_kwargs = await prompt_tokens(chat_template_kwargs={"enable_thinking": True})
    direct_off = await client.chat("Think?", max_tokens=2, enable_thinking=False)
    assert off == direct_off.usage.prompt_tokens
    assert on != off
    assert via_kwargs == on


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structural_tag"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "get_time"}}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "get_weather",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_a_bad_request_is_a_400_that_names_the_field(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess, fields: dict[str, object], named: str
) -> None:
    request: dict[str, object] = {
        "model": worker.env["EDGEQ_MODEL"],
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(**request)  # type: ignore[call-overload]
    assert refused.value.status_code == 400
    assert named in refused.value.message


async def test_a_chat_sent_again_with_its_idempotency_key_gets_the_first_ones_job(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    """A POST retried (its reply lost) with the same Idempotency-Key gets the first one's job
    and answer, not a second job; another request under that key is a 409 naming the job, and
    a malformed key a 400 naming the header."""
    key = f"retry-{uuid.uuid4().hex}"
    request: dict[str, Any] = {
        "model": worker.env["EDGEQ_MODEL"],
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 16,
        "seed": FULL_LENGTH_SEEDS[1],
        "temperature": 0.7,
    }
    with_key = {"Idempotency-Key": key}
    first = await sdk.chat.completions.with_raw_response.create(**request, extra_headers=with_key)
    again = await sdk.chat.completions.with_raw_response.create(**request, extra_headers=with_key)
    job_id = first.headers["x-edgeq-job-id"]
    assert again.headers["x-edgeq-job-id"] == job_id
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content

    with pytest.raises(openai.ConflictError) as reused:
        await sdk.chat.completions.create(**{**request, "max_tokens": 8}, extra_headers=with_key)
    assert reused.value.code == "idempotency_key_reused" and job_id in reused.value.message
    with pytest.raises(openai.BadRequestError) as malformed:
        await sdk.chat.completions.create(**request, extra_headers={"Idempotency-Key": "a b"})
    assert malformed.value.param == "Idempotency-Key" and "visible ASCII" in malformed.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_job_the_worker_refuses_is_a_400_even_when_streaming(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(
            model=worker.env["EDGEQ_MODEL"],
            messages=[{"role": "user", "content": "x" * 5000}],  # past the 1024-token context
            stream=stream,
        )
    assert refused.value.code == "prompt_too_long"
    assert "EDGEQ_MAX_MODEL_LEN" in refused.value.message
    assert refused.value.response.headers["x-edgeq-job-id"]


async def test_an_unknown_model_is_a_404_and_models_lists_the_served_one(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert "gpt-4o" in missing.value.message
    listed = [model.id async for model in sdk.models.list()]
    assert worker.env["EDGEQ_MODEL"] in listed and "Qwen-0.6B" in listed


async def test_a_streaming_client_that_disconnects_cancels_its_job(
    sdk: openai.AsyncOpenAI, client: ChatClient, worker: WorkerProcess
) -> None:
    """With the real worker, its engine slowed (``helpers.slowed``): the answer is still
    running when the first chunk is in however loaded the machine (CI runs' first chunks came
    after whole 300-token answers had ended), and held still over the disconnect."""
    with slowed(worker) as engine:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=worker.env["EDGEQ_MODEL"],
            messages=[{"role": "user", "content": "A long story, please."}],
            max_tokens=LONG,
            seed=FULL_LENGTH_SEEDS[0],
            stream=True,
        )
        stream = raw.parse()
        async for _ in stream:
            break  # the job has started (its first event is in): now walk away
        with engine.held():
            await stream.close()
            terminal = await terminal_event(client, raw.headers["x-edgeq-job-id"])
    assert isinstance(terminal, ErrorEvent), f"the job was not cancelled: {terminal}"
    assert terminal.code == "cancelled" and "disconnected" in terminal.message


async def test_a_disconnect_mid_stream_cancels_at_once(
    unserved_gateway: str, unserved_client: ChatClient, tiny_model: Path
) -> None:
    """The same, deterministic: this test plays the worker through the wire contract (as a
    worker in another language would), so the stream is surely mid-answer at the disconnect."""
    sdk = openai.AsyncOpenAI(base_url=unserved_gateway, api_key=API_KEY, max_retries=0)
    job_id, stream = await open_played_stream(sdk, str(tiny_model), unserved_client, "Once")
    events = unserved_client.events
    await events.append(DeltaEvent(job_id=job_id, seq=0, text=" upon"))
    await stream.close()
    closed = time.monotonic()

    terminal = await terminal_event(unserved_client, job_id)
    assert isinstance(terminal, ErrorEvent) and terminal.code == "cancelled"
    assert "disconnected" in terminal.message
    FIGURES["gateway: disconnect -> job cancelled (ms)"] = round(
        (time.monotonic() - closed) * 1000, 1
    )
    with pytest.raises(StreamClosed):  # the "worker" learns at its next event: it stops
        await events.append(DeltaEvent(job_id=job_id, seq=0, text=" a time"))
    await unserved_client.redis.zrem(UNSERVED_QUEUE, job_id)  # as the worker would


async def test_a_full_queue_is_a_429_with_retry_after_and_a_waiting_client_that_leaves_cancels(
    unserved_gateway: str, unserved_client: ChatClient, tiny_model: Path
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "wait"}]}
    async with httpx.AsyncClient(base_url=unserved_gateway, headers=headers) as http:
        # The first job takes the queue's one place and waits: nobody serves this queue.
        waiting = asyncio.create_task(http.post("/chat/completions", json=body, timeout=30))
        (job_id,) = await queued_job_ids(unserved_client)

        sdk = openai.AsyncOpenAI(base_url=unserved_gateway, api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as full:
            await sdk.chat.completions.create(**body)  # type: ignore[arg-type]
        assert full.value.status_code == 429
        assert full.value.response.headers["retry-after"] == "3"
        assert "EDGEQ_MAX_QUEUE" in full.value.message

        waiting.cancel()  # the HTTP client gives up on the non-streaming request
        await asyncio.gather(waiting, return_exceptions=True)
    terminal = await terminal_event(unserved_client, job_id)
    assert isinstance(terminal, ErrorEvent) and terminal.code == "cancelled"
    assert await unserved_client.queue.depth() == 0  # its place in the queue is free again


async def test_api_keys_guard_v1_but_not_the_probes(unserved_gateway: str) -> None:
    async with httpx.AsyncClient(base_url=unserved_gateway.removesuffix("/v1")) as http:
        refused = await http.get("/v1/models")
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        allowed = await http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        health = await http.get("/health")
        ready = await http.get("/ready")
    assert refused.status_code == wrong.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert allowed.status_code == 200
    assert health.status_code == 200
    assert ready.status_code == 503 and UNSERVED_QUEUE in ready.json()["reason"]


# --- priority and tenant ------------------------------------------------------------------------


async def queued_as(
    unserved_gateway: str,
    unserved_client: ChatClient,
    tiny_model: Path,
    *,
    key: str,
    headers: dict[str, str] | None = None,
    **fields: object,
) -> tuple[str, int, dict[str, object]]:
    """Send a chat through the unserved gateway and read, while its job waits, what the worker
    would claim it by: the tenant the enqueue recorded, the priority band its score is in, and
    its payload. Then hang up, which cancels the job and frees the queue's one place."""
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hi"}], **fields}
    headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    redis = unserved_client.redis
    async with httpx.AsyncClient(base_url=unserved_gateway, headers=headers) as http:
        waiting = asyncio.create_task(http.post("/chat/completions", json=body, timeout=30))
        (job_id,) = await queued_job_ids(unserved_client)
        tenant = await redis.hget(tenant_of_key(UNSERVED_QUEUE), job_id)
        score = await redis.zscore(UNSERVED_QUEUE, job_id)
        raw = await redis.get(job_key(job_id))
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    terminal = await terminal_event(unserved_client, job_id)
    assert isinstance(terminal, ErrorEvent) and terminal.code == "cancelled"
    assert tenant is not None and score is not None and raw is not None
    (payload,) = json.loads(raw)["a"]
    # The entry is "<band it was enqueued in>:<tenant>" (src/edgeq/core/scheduling.py).
    born, _, tenant_name = tenant.decode().partition(":")
    assert int(born) == int(score // BAND_SPAN)
    return tenant_name, int(score // BAND_SPAN), payload


@pytest.mark.parametrize(
    ("priority", "band", "named"),
    [
        (None, 1, None),  # left out: the default class
        (-5, 0, "interactive"),  # vLLM's direction: lower first
        (0, 1, "default"),
        (7, 2, "batch"),
        ("interactive", 0, "interactive"),
        ("batch", 2, "batch"),
    ],
)
async def test_the_body_priority_picks_the_job_class(
    unserved_gateway: str,
    unserved_client: ChatClient,
    tiny_model: Path,
    priority: int | str | None,
    band: int,
    named: str | None,
) -> None:
    fields = {} if priority is None else {"priority": priority}
    tenant, queued_band, payload = await queued_as(
        unserved_gateway, unserved_client, tiny_model, key=API_KEY, **fields
    )
    assert queued_band == band
    assert payload.get("priority") == named  # what the worker hands vLLM's scheduler
    assert tenant == payload["tenant"] == GATEWAY_TENANT  # nothing named one: EDGEQ_TENANT


@pytest.mark.parametrize(
    ("key", "header", "expected"),
    [
        (API_KEY, "acme", "acme"),  # a plain key: the header names the tenant
        (TENANT_KEY, None, "nightly"),  # a tenant key fixes it
        (TENANT_KEY, "nightly", "nightly"),  # the key's own tenant named: fine
        ("sk-reports", None, "reports"),
    ],
)
async def test_the_tenant_comes_from_a_tenant_key_or_the_header(
    unserved_gateway: str,
    unserved_client: ChatClient,
    tiny_model: Path,
    key: str,
    header: str | None,
    expected: str,
) -> None:
    headers = {} if header is None else {"X-Edgeq-Tenant": header}
    tenant, band, payload = await queued_as(
        unserved_gateway, unserved_client, tiny_model, key=key, headers=headers, priority=1
    )
    assert tenant == payload["tenant"] == expected
    assert band == 2


@pytest.mark.parametrize(
    ("key", "headers", "fields", "status", "code", "named"),
    [
        (TENANT_KEY, {"X-Edgeq-Tenant": "acme"}, {}, 403, "tenant_mismatch", "X-Edgeq-Tenant"),
        (API_KEY, {"X-Edgeq-Tenant": "no spaces"}, {}, 400, "invalid_tenant", "X-Edgeq-Tenant"),
        (TENANT_KEY, {"X-Edgeq-Tenant": "-x"}, {}, 400, "invalid_tenant", "X-Edgeq-Tenant"),
        (API_KEY, {}, {"priority": 1.5}, 400, "invalid_request", "priority"),
        (API_KEY, {}, {"priority": 1.0}, 400, "invalid_request", "priority"),
        (API_KEY, {}, {"priority": True}, 400, "invalid_request", "priority"),
        (API_KEY, {}, {"priority": "urgent"}, 400, "invalid_request", "priority"),
        (API_KEY, {}, {"priority": "-1"}, 400, "invalid_request", "priority"),
        ("c2stbmlnaHRseQ", {}, {}, 401, "invalid_api_key", "EDGEQ_GATEWAY_TENANT_KEYS"),
    ],
)
async def test_a_wrong_tenant_or_priority_is_refused_before_anything_is_queued(
    unserved_gateway: str,
    unserved_client: ChatClient,
    tiny_model: Path,
    key: str,
    headers: dict[str, str],
    fields: dict[str, object],
    status: int,
    code: str,
    named: str,
) -> None:
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hi"}], **fields}
    headers = {"Authorization": f"Bearer {key}", **headers}
    async with httpx.AsyncClient(base_url=unserved_gateway, headers=headers) as http:
        refused = await http.post("/chat/completions", json=body, timeout=30)
    assert refused.status_code == status
    error = refused.json()["error"]
    assert error["code"] == code and named in error["message"]
    if named == "priority":
        assert error["param"] == "priority"
        assert all(name in error["message"] for name in ("interactive", "default", "batch"))
    if status == 403:  # the SDKs' PermissionDeniedError; the key's tenant is said, not hidden
        assert error["type"] == "permission_error" and "nightly" in error["message"]
    assert await unserved_client.queue.depth() == 0


def queue_time_counts(worker: WorkerProcess) -> dict[tuple[str, str], float]:
    """The worker's edgeq:request_queue_time_seconds_count by (priority, tenant label)."""
    page = httpx.get(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).text
    return {
        (sample.labels["priority"], sample.labels["tenant"]): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "edgeq:request_queue_time_seconds_count"
    }


async def test_the_worker_runs_a_gateway_job_in_the_class_and_tenant_it_was_sent_with(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    """The whole way: the worker's metrics count each job under the class it ran in and its
    tenant ("other" for one the worker's settings do not name, as this "acme")."""
    sent = [(-1, None, ("interactive", "default")), ("batch", "acme", ("batch", "other"))]
    for priority, tenant, labels in sent:
        before = queue_time_counts(worker).get(labels, 0.0)
        headers = {} if tenant is None else {"X-Edgeq-Tenant": tenant}
        await sdk.chat.completions.create(
            model=worker.env["EDGEQ_MODEL"],
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"priority": priority},
            extra_headers=headers,
        )
        assert queue_time_counts(worker).get(labels, 0.0) == before + 1, labels


async def test_ready_says_a_warm_worker_serves_the_queue(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.removesuffix("/v1")) as http:
        ready = await http.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["workers"] >= 1


async def test_ready_counts_no_stalled_worker_and_says_so(
    unserved_gateway: str, unserved_client: ChatClient
) -> None:
    # The record a worker whose engine stalled writes with its heartbeat (worker/liveness.py).
    stalled = WorkerInfo(
        worker_id="box:4242", host="box", pid=4242, queue=UNSERVED_QUEUE, model="m", profile=None,
        device="cpu", state="stalled", stalled_since=time.time() - 5, running=2, max_jobs=8,
        metrics_port=None, started_at=time.time() - 60, heartbeat_at=time.time(),
    )  # fmt: skip
    await publish_heartbeat(unserved_client.redis, stalled, ttl_s=30)
    try:
        async with httpx.AsyncClient(base_url=unserved_gateway.removesuffix("/v1")) as http:
            ready = await http.get("/ready")
    finally:
        await remove_worker(unserved_client.redis, UNSERVED_QUEUE, stalled.worker_id)
    assert ready.status_code == 503
    assert "1 stalled" in ready.json()["reason"], ready.json()


def test_langchain_chat_openai_streams_through_the_gateway_as_in_the_seed(
    gateway: str, worker: WorkerProcess
) -> None:
    """The seed's client code, pointed at the gateway, unchanged but for the URL and model."""
    langchain_openai = pytest.importorskip("langchain_openai")
    client = httpx.Client(
        base_url=gateway,
        timeout=30.0,
        limits=httpx.Limits(max_keepalive_connections=20, max_connections=100),
    )
    chat_model = langchain_openai.ChatOpenAI(
        model="Qwen-0.6B",  # the seed's model name, accepted through EDGEQ_GATEWAY_MODEL_ALIASES
        api_key="EMPTY",
        base_url=gateway,
        http_client=client,
        streaming=True,
        temperature=0.5,
        top_p=0.9,
        max_tokens=32,
        seed=FULL_LENGTH_SEEDS[0],
        extra_body={"enable_thinking": False, "return_reasoning": False},
    )
    pieces = [chunk.content for chunk in chat_model.stream("请简述量子力学的基本原理")]
    client.close()
    text = "".join(str(piece) for piece in pieces)
    assert len([piece for piece in pieces if piece]) >= 2, "nothing was streamed"
    assert text.strip()


async def test_sigterm_lets_an_open_stream_finish_then_the_gateway_exits(
    redis_server: RedisServer,
    unserved_client: ChatClient,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Again playing the worker by hand, so the stream is open exactly when SIGTERM comes."""
    env = {"EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_QUEUE": UNSERVED_QUEUE,
           "EDGEQ_MODEL": str(tiny_model), "EDGEQ_GATEWAY_SHUTDOWN_TIMEOUT_S": "10"}  # fmt: skip
    gateway = GatewayProcess(env, tmp_path / "gateway.log").start()
    job_id = ""
    try:
        sdk = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="EMPTY", max_retries=0)
        job_id, stream = await open_played_stream(sdk, str(tiny_model), unserved_client, "Still")
        events = unserved_client.events
        texts: list[str | None] = ["Still"]
        assert gateway.process is not None
        gateway.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # the gateway is draining now
        await events.append(DeltaEvent(job_id=job_id, seq=0, text=" here."))
        usage = Usage(prompt_tokens=3, completion_tokens=2)
        timings = Timings(queued_ms=1, ttft_ms=2, total_ms=3)
        await events.append(
            DoneEvent(job_id=job_id, seq=0, finish_reason="stop", usage=usage, timings=timings)
        )
        texts += [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert "".join(text or "" for text in texts) == "Still here."
        # uvicorn re-raises the signal once it has shut down; systemd counts that as clean.
        assert await asyncio.to_thread(gateway.process.wait, 20) in (0, -signal.SIGTERM)
        assert "Traceback" not in (tmp_path / "gateway.log").read_text()
    finally:
        gateway.stop()
        if job_id:
            await unserved_client.redis.zrem(UNSERVED_QUEUE, job_id)


def test_a_port_already_taken_is_a_clear_error_with_exit_69(redis_server: RedisServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_GATEWAY_PORT": str(port)}
        ran = subprocess.run(
            [*EDGEQ, "gateway"], env=env, capture_output=True, text=True, timeout=60
        )
    assert ran.returncode == 69
    assert f"could not start on 127.0.0.1:{port}" in ran.stderr
    assert "EDGEQ_GATEWAY_PORT" in ran.stderr


def test_host_and_port_flags_win_over_the_settings(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    """`edgeq gateway --host H --port P`, as `vllm serve` and uvicorn take them."""
    flagged, configured = free_port(), free_port()
    env = {**os.environ, "EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_MODEL": str(tiny_model),
           "EDGEQ_GATEWAY_HOST": "127.0.0.2", "EDGEQ_GATEWAY_PORT": str(configured)}  # fmt: skip
    with (tmp_path / "gateway.log").open("wb") as log:
        process = subprocess.Popen(
            [*EDGEQ, "gateway", "--host", "127.0.0.1", "--port", str(flagged)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_port(flagged, timeout_s=60)
        assert httpx.get(f"http://127.0.0.1:{flagged}/health", timeout=10).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.2:{configured}/health", timeout=2)
    finally:
        stop_process(process, signal.SIGTERM)


@pytest.mark.parametrize("stream", [False, True])
async def test_return_reasoning_comes_back_as_reasoning_content(
    sdk: openai.AsyncOpenAI, client: ChatClient, worker: WorkerProcess, stream: bool
) -> None:
    fields = {"max_tokens": 48, "temperature": 1.0, "seed": 3, "enable_thinking": True}
    direct = await client.chat("Think hard.", return_reasoning=True, **fields)
    request = {
        "model": worker.env["EDGEQ_MODEL"],
        "messages": [{"role": "user", "content": "Think hard."}],
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"enable_thinking": True, "return_reasoning": True},
    }
    if stream:
        chunks = [c async for c in await sdk.chat.completions.create(stream=True, **request)]
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        text = "".join(delta.content or "" for delta in deltas)
        reasoning = [(delta.model_extra or {}).get("reasoning_content") for delta in deltas]
        assert [r for r in reasoning if r is not None] == [direct.reasoning]
    else:
        completion = await sdk.chat.completions.create(**request)
        message = completion.choices[0].message
        text = message.content or ""
        assert (message.model_extra or {}).get("reasoning_content") == direct.reasoning
    assert direct.reasoning is not None
    assert text == direct.text


# --- structured output and tools through the gateway -------------------------------------------


class Reporter(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    id: int


class Ticket(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=16)
    kind: Literal["bug", "feature", "question"]
    reporter: Reporter


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


async def test_the_openai_sdk_parse_returns_a_pydantic_instance(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    for seed in range(3):
        completion = await sdk.chat.completions.parse(
            model=worker.env["EDGEQ_MODEL"],
            messages=[{"role": "user", "content": "Open a ticket"}],
            response_format=Ticket,
            max_tokens=400,
            seed=seed,
        )
        assert isinstance(completion.choices[0].message.parsed, Ticket)


async def test_sdk_tool_calls_come_back_as_openai_sends_them_and_the_result_goes_back(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    model = worker.env["EDGEQ_MODEL"]
    question = {"role": "user", "content": "Weather in Oslo?"}
    completion = await sdk.chat.completions.create(
        model=model,
        messages=[question],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call at most
        seed=1,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    answer = await sdk.chat.completions.create(
        model=model,
        messages=[
            question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "4 C, rain"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=4,
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The history (tools section, the call, the tool's answer) made the prompt longer.
    assert answer.usage.prompt_tokens > completion.usage.prompt_tokens


async def test_streamed_tool_calls_arrive_whole_before_the_finish_chunk(
    sdk: openai.AsyncOpenAI, worker: WorkerProcess
) -> None:
    stream = await sdk.chat.completions.create(
        model=worker.env["EDGEQ_MODEL"],
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    [with_calls] = [delta for delta in deltas if delta.tool_calls]
    [call] = with_calls.tool_calls
    assert (call.index, call.function.name) == (0, "get_weather")
    assert "city" in json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_logprobs_come_back_per_token(sdk: openai.AsyncOpenAI, worker: WorkerProcess) -> None:
    completion = await sdk.chat.completions.create(
        model=worker.env["EDGEQ_MODEL"],
        messages=[{"role": "user", "content": "Approve?"}],
        extra_body={"structured_outputs": {"choice": ["approve", "reject"]}},
        logprobs=True,
        top_logprobs=3,
    )
    choice = completion.choices[0]
    assert choice.message.content in ("approve", "reject")
    content = choice.logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)


def test_langchain_structured_output_and_bound_tools_work_unchanged(
    gateway: str, worker: WorkerProcess
) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat_model = langchain_openai.ChatOpenAI(
        model=worker.env["EDGEQ_MODEL"], api_key="EMPTY", base_url=gateway, max_tokens=400, seed=2
    )
    ticket = chat_model.with_structured_output(Ticket).invoke("Open a ticket")
    assert isinstance(ticket, Ticket)
    message = chat_model.bind_tools([WEATHER_TOOL], tool_choice="any").invoke("Weather in Rome?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}


def test_edgeq_bench_runs_the_gateway_as_one_of_several_openai_modes(
    gateway: str, tiny_model: Path
) -> None:
    """`edgeq bench --openai A --openai B`: each server's run carries its own mode's name."""
    spec = WorkloadSpec(
        num_requests=2, input_len_min=32, input_len_max=48, max_tokens=8,
        temperature=0.5, top_p=0.9, seed=0,
    )  # fmt: skip
    tokenizer = load_tokenizer(str(tiny_model))
    workload = build_workload(spec, tokenizer, str(tiny_model))
    plan = ModePlan("openai-2", ModeKind.OPENAI, url=gateway.removesuffix("/v1"))
    run = run_plan(plan, workload, 2, count_tokens=lambda text: len(tokenizer.encode(text)))
    assert run.error is None, run.error
    assert run.name == "openai-2"
    assert [record.success for record in run.records] == [True, True]
