"""What the gateway takes as input, against a real gateway process on the suite's Redis, no
worker (every accepted job waits in a queue nobody serves): strings that cannot be encoded,
OpenAI's metadata limits, strict types and the field each error names, and the Responses
stream's events as the official openai SDK reads them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, get_args

import httpx
import openai
import pytest
from openai.types.responses import ResponseErrorEvent, ResponseStreamEvent

from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.core.structured import FunctionCall, ToolCall
from edgeq.gateway.response_events import ResponseEvents, error_event
from edgeq.testing.processes import GatewayProcess, RedisServer

QUEUE = "edgeq:input-unserved"
MODEL = "tiny"
ACME = "sk-input-acme"
STREAM_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def gateway(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": QUEUE,
        "EDGEQ_MODEL": MODEL,
        "EDGEQ_GATEWAY_TENANT_KEYS": f"acme={ACME}",
        # No worker: a stream gives up after this long, and its Responses stream ends in an
        # error event (the gateway lost the job's stream).
        "EDGEQ_STREAM_TIMEOUT_S": str(STREAM_TIMEOUT_S),
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("input") / "gateway.log").start()
    yield process
    process.stop()


@pytest.fixture
def acme(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {ACME}"}, timeout=30
    ) as client:
        yield client


# --- the Responses stream, as the SDK reads it --------------------------------------------

#: The SDK's class for each type of Responses stream event (its union's members).
SDK_EVENT_CLASS = {
    get_args(member.model_fields["type"].annotation)[0]: member
    for member in get_args(get_args(ResponseStreamEvent)[0])
}


def _request() -> dict[str, Any]:
    return {"job_id": "j1", "created_at": time.time(), "model": MODEL, "background": False,
            "store": True}  # fmt: skip


def _done(**fields: Any) -> DoneEvent:
    timings = Timings(queued_ms=1, ttft_ms=2, total_ms=3)
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    return DoneEvent(job_id="j1", seq=2, usage=usage, timings=timings, **fields)


CALL = ToolCall(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))
ENDINGS = {
    "completed": [_done(finish_reason="stop")],
    "incomplete": [_done(finish_reason="length")],
    "tool calls": [_done(finish_reason="tool_calls", tool_calls=[CALL, CALL])],
    "failed": [ErrorEvent(job_id="j1", seq=2, code="engine_error", message="boom")],
    "cancelled": [ErrorEvent(job_id="j1", seq=2, code="cancelled", message="by someone")],
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_event_of_a_responses_stream_parses_as_its_own_type_in_the_sdk(
    ending: str,
) -> None:
    mapper = ResponseEvents(_request())
    events = mapper.opening()
    for job_event in [DeltaEvent(job_id="j1", seq=0, text="Hel"),
                      DeltaEvent(job_id="j1", seq=1, text="lo"), *ENDINGS[ending]]:  # fmt: skip
        events += mapper.feed(job_event)
    events.append(error_event({"message": "lost", "type": "server_error", "code": "x"}, 9))
    for event in events:
        # Strict: every field the SDK's class requires is there, with its type.
        SDK_EVENT_CLASS[event["type"]].model_validate(event)
    assert SDK_EVENT_CLASS[events[-1]["type"]] is ResponseErrorEvent


def test_a_responses_stream_that_loses_its_job_ends_in_an_error_event_the_sdk_yields(
    acme: openai.OpenAI,
) -> None:
    stream = acme.responses.create(model=MODEL, input="hi", stream=True)
    events = list(stream)
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert isinstance(last, ResponseErrorEvent), f"the stream ended with {last!r}"
    assert last.code == "stream_timeout"
    assert "EDGEQ_STREAM_TIMEOUT_S" in last.message or "no event" in last.message
    assert last.sequence_number == events[-2].sequence_number
