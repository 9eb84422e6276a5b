"""OpenAI's Responses API over `edgeq gateway --workers 2`, driven by the official `openai`
SDK against the session's real worker: background responses, streams dropped and resumed
(also after the gateway was SIGKILLed), cancel, delete, previous_response_id, signed webhooks
to a receiver in the test, and bad input that enqueues nothing."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis import Redis as SyncRedis

from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from helpers import FLAKY_REFUSALS, FULL_LENGTH_SEEDS, WebhookReceiver, slowed

pytestmark = pytest.mark.engine

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
LONG = 300
UNSERVED_QUEUE = "edgeq:responses-unserved"


@pytest.fixture(scope="module")
def receiver() -> Iterator[WebhookReceiver]:
    server = WebhookReceiver()
    yield server
    server.close()


def gateway_env(worker: WorkerProcess, receiver: WebhookReceiver, **more: str) -> dict[str, str]:
    webhooks = [
        {"url": receiver.url("/ok"), "secret": SECRET},
        {"url": receiver.url("/flaky"), "secret": SECRET},
    ]
    return {
        **{name: worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")},
        "EDGEQ_GATEWAY_WEBHOOKS": json.dumps(webhooks),
        "EDGEQ_GATEWAY_WEBHOOK_BACKOFF_S": "0.2",
        "EDGEQ_GATEWAY_RESPONSE_LEASE_S": "2",
        **more,
    }


@pytest.fixture(scope="module")
def gateway(
    worker: WorkerProcess, receiver: WebhookReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """`edgeq gateway` with two processes (EDGEQ_GATEWAY_WORKERS=2) before the session's
    worker: a request may land on either, so every resume below crosses processes too."""
    env = gateway_env(worker, receiver, EDGEQ_GATEWAY_WORKERS="2")
    process = GatewayProcess(env, tmp_path_factory.mktemp("gateway") / "gateway.log").start()
    yield process
    kill_group(process, signal.SIGTERM)


def kill_group(process: GatewayProcess, sig: signal.Signals) -> None:
    """Signal the gateway and its worker processes (its own session: spawn_edgeq)."""
    assert process.process is not None
    try:
        os.killpg(process.process.pid, sig)
    except ProcessLookupError:
        return
    try:
        process.process.wait(timeout=20)
    except Exception:
        os.killpg(process.process.pid, signal.SIGKILL)
        process.process.wait()


@pytest.fixture
def sdk(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)


def model(worker: WorkerProcess) -> str:
    return worker.env["EDGEQ_MODEL"]


def until_ended(sdk: openai.OpenAI, response_id: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.2)
    raise AssertionError(f"{response_id} did not end in {timeout_s} s")


def wait_for(check: Any, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def read_events(stream: Any, count: int | None = None) -> list[Any]:
    events = []
    for event in stream:
        events.append(event)
        if count is not None and len(events) == count:
            break
    return events


def text_of(events: list[Any]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


def test_background_response_completes_and_is_delivered_signed(
    sdk: openai.OpenAI, worker: WorkerProcess, receiver: WebhookReceiver
) -> None:
    created = sdk.responses.create(
        model=model(worker),
        input="Say hello.",
        instructions="Answer briefly.",
        max_output_tokens=16,
        background=True,
        metadata={"case": "background"},
    )
    assert created.id.startswith("resp_") and created.status == "queued"
    done = until_ended(sdk, created.id)
    assert done.status in ("completed", "incomplete")
    assert done.output_text and done.usage is not None and done.usage.output_tokens > 0
    assert done.metadata == {"case": "background"} and done.instructions == "Answer briefly."

    webhook_id = f"evt_{created.id.removeprefix('resp_')}"
    (headers, body), *more = wait_for(lambda: receiver.accepted("/ok", webhook_id))
    assert not more
    event = openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(body, headers)
    assert event.type == f"response.{done.status}" and event.data.id == created.id
    # Refused three times, it is delivered later, once, with the same webhook-id each time.
    accepted = wait_for(lambda: receiver.accepted("/flaky", webhook_id))
    assert len(accepted) == 1 and receiver.attempts("/flaky", webhook_id) == FLAKY_REFUSALS + 1
    wrong = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused", webhook_secret=wrong).webhooks.unwrap(body, headers)


def assert_resumed(first: list[Any], rest: list[Any], final: Any) -> None:
    """The two halves are one gap-free stream whose text is the stored output."""
    numbers = [event.sequence_number for event in first + rest]
    assert numbers == list(range(len(numbers))), numbers
    assert first[0].type == "response.created"
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert text_of(first + rest) == final.output_text
    assert rest[-1].response.output_text == final.output_text


def test_a_dropped_stream_resumes_where_it_stopped(
    sdk: openai.OpenAI, worker: WorkerProcess
) -> None:
    with slowed(worker):  # so that the stream is resumed while the answer still runs
        stream = sdk.responses.create(
            model=model(worker),
            input="Tell a long story.",
            max_output_tokens=LONG,
            background=True,
            stream=True,
            extra_body={"seed": FULL_LENGTH_SEEDS[0]},
        )
        first = read_events(stream, 8)
        stream.close()  # the client drops; a background response runs on
        response_id = first[0].response.id
        assert sdk.responses.retrieve(response_id).status == "in_progress"
        rest = read_events(
            sdk.responses.retrieve(
                response_id, stream=True, starting_after=first[-1].sequence_number
            )
        )
    final = until_ended(sdk, response_id)
    assert final.status == "incomplete" and final.usage.output_tokens == LONG
    assert_resumed(first, rest, final)
    # A replay of an ended response from its start is the same stream again.
    again = read_events(sdk.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in again] == [event.model_dump() for event in first + rest]


def test_a_stream_resumes_after_its_gateway_was_killed(
    sdk: openai.OpenAI,
    worker: WorkerProcess,
    receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    doomed = GatewayProcess(gateway_env(worker, receiver), tmp_path / "doomed.log").start()
    with slowed(worker):  # so that the stream is resumed while the answer still runs
        try:
            other = openai.OpenAI(base_url=doomed.base_url, api_key="unused", max_retries=0)
            stream = other.responses.create(
                model=model(worker),
                input="Tell another long story.",
                max_output_tokens=LONG,
                background=True,
                stream=True,
                extra_body={"seed": FULL_LENGTH_SEEDS[1]},
            )
            first = read_events(stream, 6)
        finally:
            kill_group(doomed, signal.SIGKILL)
        assert sdk.responses.retrieve(first[0].response.id).status == "in_progress"
        rest = read_events(
            sdk.responses.retrieve(
                first[0].response.id, stream=True, starting_after=first[-1].sequence_number
            )
        )
    assert_resumed(first, rest, until_ended(sdk, first[0].response.id))


def test_a_response_continues_a_previous_one(sdk: openai.OpenAI, worker: WorkerProcess) -> None:
    # A seed that runs to length: unseeded, the tiny model once drew <|im_end|> first, an
    # empty answer (a CI run).
    seeded = {"seed": FULL_LENGTH_SEEDS[0]}
    first = sdk.responses.create(
        model=model(worker), input="Name a colour.", max_output_tokens=8, extra_body=seeded
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    follow_up = sdk.responses.create(
        model=model(worker),
        input="And another one.",
        max_output_tokens=8,
        previous_response_id=first.id,
        extra_body=seeded,
    )
    assert follow_up.previous_response_id == first.id and follow_up.output_text
    # The follow-up's prompt carries the first exchange: it is longer than the same input
    # alone by at least the first's answer.
    alone = sdk.responses.create(
        model=model(worker), input="And another one.", max_output_tokens=1, extra_body=seeded
    )
    assert follow_up.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens


def test_function_calls_come_as_openai_sends_them(
    sdk: openai.OpenAI, worker: WorkerProcess
) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    events = read_events(
        sdk.responses.create(
            model=model(worker),
            input="Weather in Paris?",
            tools=[tool],
            tool_choice="required",
            stream=True,
            extra_body={"seed": 2},
        )
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    calls = [event.item for event in events if event.type == "response.output_item.done"]
    assert calls and calls[-1].type == "function_call" and calls[-1].name == "get_weather"
    assert "city" in json.loads(calls[-1].arguments)
    final = events[-1].response
    assert final.output[-1].call_id == calls[-1].call_id


# --- bad input: a gateway on a queue no worker serves, so whatever is enqueued stays -----------


@pytest.fixture(scope="module")
def unserved(
    redis_server: RedisServer, worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": UNSERVED_QUEUE,
        "EDGEQ_MODEL": worker.env["EDGEQ_MODEL"],
        "EDGEQ_MAX_REQUEST_BYTES": "4000",
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("unserved") / "gateway.log").start()
    yield process
    kill_group(process, signal.SIGTERM)


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"input": "hi", "temperatur": 0.5}, 400, "temperatur"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
        (
            {
                "input": "hi",
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}
                },
            },
            400,
            "text.format.schema",
        ),
        ({"input": "hi", "previous_response_id": "resp_nothere"}, 400, "previous_response_id"),
        ({"input": "x" * 5000}, 400, "EDGEQ_MAX_REQUEST_BYTES"),
        ({"input": "hi", "background": True, "store": False}, 400, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_enqueued(
    unserved: GatewayProcess,
    redis_server: RedisServer,
    worker: WorkerProcess,
    body: dict[str, Any],
    status: int,
    named: str,
) -> None:
    reply = httpx.post(
        f"{unserved.base_url}/responses", json={"model": model(worker), **body}, timeout=30
    )
    assert reply.status_code == status, reply.text
    assert named in reply.json()["error"]["message"]
    assert SyncRedis.from_url(redis_server.url).zcard(UNSERVED_QUEUE) == 0


def test_malformed_json_another_tenants_response_cancel_and_delete(
    unserved: GatewayProcess, redis_server: RedisServer, worker: WorkerProcess
) -> None:
    reply = httpx.post(
        f"{unserved.base_url}/responses",
        content=b'{"model": "x", "input": ',
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    created = httpx.post(
        f"{unserved.base_url}/responses",
        json={"model": model(worker), "input": "hi", "background": True},
        headers={"X-Edgeq-Tenant": "alice"},
    ).json()
    redis = SyncRedis.from_url(redis_server.url)
    try:
        assert redis.zcard(UNSERVED_QUEUE) == 1
        mine = httpx.get(
            f"{unserved.base_url}/responses/{created['id']}", headers={"X-Edgeq-Tenant": "alice"}
        )
        assert mine.status_code == 200 and mine.json()["status"] == "queued"
        theirs = httpx.get(
            f"{unserved.base_url}/responses/{created['id']}", headers={"X-Edgeq-Tenant": "bob"}
        )
        assert theirs.status_code == 404 and created["id"] in theirs.json()["error"]["message"]
        follow = httpx.post(
            f"{unserved.base_url}/responses",
            json={"model": model(worker), "input": "hi", "previous_response_id": created["id"]},
            headers={"X-Edgeq-Tenant": "bob"},
        )
        assert follow.status_code == 400 and "previous_response_id" in follow.text
        assert redis.zcard(UNSERVED_QUEUE) == 1
        sdk = openai.OpenAI(
            base_url=unserved.base_url,
            api_key="unused",
            max_retries=0,
            default_headers={"X-Edgeq-Tenant": "alice"},
        )
        assert sdk.responses.cancel(created["id"]).status == "cancelled"
        assert sdk.responses.retrieve(created["id"]).status == "cancelled"
    finally:
        httpx.delete(
            f"{unserved.base_url}/responses/{created['id']}", headers={"X-Edgeq-Tenant": "alice"}
        )
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created["id"])
