"""Webhooks and response events without an engine: signatures the `openai` SDK verifies,
delivery from the Redis queue (retries with one webhook-id, a dead endpoint holding up no
other, events queued while no gateway ran), and the Responses stream numbered as a pure
function of a job's events."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from redis.asyncio import Redis

from edgeq.core.keys import webhooks_due_key as due_key
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.core.structured import FunctionCall, ToolCall
from edgeq.core.tasks import cancel_and_wait
from edgeq.gateway.settings import GatewaySettings
from edgeq.resources.responses.events import ResponseEvents, final_state, response_json
from edgeq.resources.responses.store import StoredResponse
from edgeq.resources.webhooks import WebhookSender, enqueue_event, sign
from edgeq.testing.processes import RedisServer
from helpers import WebhookReceiver

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def unwrap(body: bytes, headers: dict[str, str], secret: str = SECRET) -> Any:
    return openai.OpenAI(api_key="unused", webhook_secret=secret).webhooks.unwrap(body, headers)


def test_a_signature_is_what_the_openai_sdk_verifies() -> None:
    body = json.dumps({"id": "evt_1", "type": "response.completed", "created_at": 1,
                       "data": {"id": "resp_1"}, "object": "event"}).encode()  # fmt: skip
    now = int(time.time())
    headers = {"webhook-id": "evt_1", "webhook-timestamp": str(now),
               "webhook-signature": sign(SECRET, "evt_1", now, body)}  # fmt: skip
    event = unwrap(body, headers)
    assert event.type == "response.completed" and event.data.id == "resp_1"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(body, headers, "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(body.replace(b"resp_1", b"resp_2"), headers)
    plain = "a-plain-secret-string"  # not whsec_: used as it is, as the SDK does
    headers["webhook-signature"] = sign(plain, "evt_1", now, body)
    assert unwrap(body, headers, plain).data.id == "resp_1"


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    server = WebhookReceiver()
    yield server
    server.close()


def settings_for(
    redis_server: RedisServer, queue: str, *paths: str, **more: Any
) -> GatewaySettings:
    return GatewaySettings(
        redis_url=redis_server.url,
        queue=queue,
        gateway_webhooks=[{"url": url, "secret": SECRET} for url in paths],
        gateway_webhook_backoff_s=0.1,
        **more,
    )


@pytest.fixture
async def sending() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    await cancel_and_wait(*tasks)


async def wait_for(check: Any, timeout_s: float = 10) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_an_event_queued_while_no_gateway_ran_is_delivered_once_per_endpoint_after_retries(
    redis: Redis,
    redis_server: RedisServer,
    queue: str,
    receiver: WebhookReceiver,
    sending: list[asyncio.Task[None]],
) -> None:
    settings = settings_for(redis_server, queue, receiver.url("/ok"), receiver.url("/flaky"))
    # Queued before any sender runs (a gateway that died after its follower queued it).
    queued = await enqueue_event(
        redis, settings, event_type="response.completed", object_id="resp_abc", tenant=None
    )
    assert queued == 2 and await redis.zcard(due_key(queue)) == 2
    sending.append(asyncio.create_task(WebhookSender(redis, settings).run()))
    [(headers, body)] = await wait_for(lambda: receiver.delivered("/ok"))
    assert unwrap(body, headers).data.id == "resp_abc"
    await wait_for(lambda: receiver.delivered("/flaky"))
    attempts = [got for got in receiver.got if got[0] == "/flaky"]
    assert len(attempts) == 4  # three refused, then taken
    assert {got[1]["webhook-id"] for got in attempts} == {headers["webhook-id"]}
    # The waits doubled: 0.1, 0.2, 0.4 s.
    gaps = [b[4] - a[4] for a, b in itertools.pairwise(attempts)]
    assert gaps[2] > gaps[0]
    for _ in range(100):  # delivered everywhere: nothing left in the queue
        if await redis.zcard(due_key(queue)) == 0:
            break
        await asyncio.sleep(0.05)
    assert await redis.zcard(due_key(queue)) == 0
    # Queued again (a follower that died before it recorded the end): a new delivery, same id.
    await enqueue_event(
        redis, settings, event_type="response.completed", object_id="resp_abc", tenant=None
    )
    await wait_for(lambda: len(receiver.delivered("/ok")) == 2)
    assert {h["webhook-id"] for h, _ in receiver.delivered("/ok")} == {headers["webhook-id"]}


async def test_a_hanging_endpoint_holds_up_no_other_and_a_tenants_endpoint_gets_its_own_only(
    redis: Redis,
    redis_server: RedisServer,
    queue: str,
    receiver: WebhookReceiver,
    sending: list[asyncio.Task[None]],
) -> None:
    settings = GatewaySettings(
        redis_url=redis_server.url,
        queue=queue,
        gateway_webhooks=[
            {"url": receiver.url("/hang"), "secret": SECRET},
            {"url": receiver.url("/ok"), "secret": SECRET, "tenant": "acme"},
        ],
        gateway_webhook_timeout_s=20,
        gateway_webhook_concurrency=1,
    )
    sending.append(asyncio.create_task(WebhookSender(redis, settings).run()))
    for number in range(3):
        await enqueue_event(
            redis, settings, event_type="response.completed",
            object_id=f"resp_{number}", tenant="acme" if number else "other",
        )  # fmt: skip
    started = time.monotonic()
    delivered = await wait_for(
        lambda: len(receiver.delivered("/ok")) == 2 and receiver.delivered("/ok")
    )
    assert time.monotonic() - started < 5  # not after /hang's 20 s timeout
    assert sorted(unwrap(b, h).data.id for h, b in delivered) == ["resp_1", "resp_2"]


# --- the Responses stream as a function of the job's events ---------------------------------

REQUEST = StoredResponse(job_id="j1", created_at=1000.0, model="m", background=True, store=True)


def job_events(with_calls: bool = False) -> list[DeltaEvent | DoneEvent | ErrorEvent]:
    deltas = [DeltaEvent(job_id="j1", seq=i, text=t) for i, t in enumerate(["Hel", "", "lo"])]
    calls = [ToolCall(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))]
    done = DoneEvent(
        job_id="j1", seq=3, finish_reason="tool_calls" if with_calls else "stop",
        usage=Usage(prompt_tokens=5, completion_tokens=3),
        timings=Timings(queued_ms=1, ttft_ms=2, total_ms=30),
        tool_calls=calls if with_calls else None,
    )  # fmt: skip
    return [*deltas, done]


def numbered(events: list[Any]) -> list[dict[str, Any]]:
    mapper = ResponseEvents(REQUEST)
    out = mapper.opening()
    for event in events:
        out += mapper.feed(event)
    return out


@pytest.mark.parametrize("with_calls", [False, True])
def test_every_prefix_of_a_jobs_events_numbers_the_stream_the_same(with_calls: bool) -> None:
    events = job_events(with_calls)
    whole = numbered(events)
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    for cut in range(len(events) + 1):  # a stream read up to any job event, then resumed
        assert numbered(events[:cut]) == whole[: len(numbered(events[:cut]))]
    kinds = [e["type"] for e in whole]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds.count("response.output_text.delta") == 2  # the empty delta sends nothing
    assert kinds[-1] == "response.completed"
    final = whole[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["total_tokens"] == 8
    assert final == response_json(REQUEST, final_state(REQUEST, events))
    if with_calls:
        assert final["output"][1]["type"] == "function_call"
        assert final["output"][1]["call_id"] == "call_1"
        assert "response.function_call_arguments.done" in kinds


def test_a_cancelled_job_is_a_cancelled_response_and_a_cut_one_incomplete() -> None:
    cancelled = [ErrorEvent(job_id="j1", seq=0, code="cancelled", message="by the test")]
    assert final_state(REQUEST, cancelled).status == "cancelled"
    failed = [ErrorEvent(job_id="j1", seq=0, code="engine_error", message="boom")]
    body = response_json(REQUEST, final_state(REQUEST, failed))
    assert body["status"] == "failed" and "engine_error" in body["error"]["message"]
    cut = job_events()
    cut[-1] = cut[-1].model_copy(update={"finish_reason": "length"})
    body = response_json(REQUEST, final_state(REQUEST, cut))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
