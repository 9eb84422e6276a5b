"""What the gateway takes as input, against a real gateway process on the suite's Redis, no
worker (every accepted job waits in a queue nobody serves): strings that cannot be encoded,
OpenAI's metadata limits, strict types and the field each error names, and the Responses
stream's events as the official openai SDK reads them.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from typing import Any, get_args

import httpx
import openai
import pytest
import redis as sync_redis
from openai.types.responses import ResponseErrorEvent, ResponseStreamEvent
from redis.asyncio import Redis

from edgeq.core.fingerprint import request_fingerprint
from edgeq.core.keys import batches_key, files_key, poison_refusal_key
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage, job_payload
from edgeq.core.settings import ConnectionSettings
from edgeq.core.structured import FunctionCall, ToolCall
from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import build_request
from edgeq.resources.batches.store import BatchStore
from edgeq.resources.openai_api import ChatCompletionRequest
from edgeq.resources.responses.events import ResponseEvents, error_event
from edgeq.resources.responses.store import StoredResponse
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


def _request() -> StoredResponse:
    return StoredResponse(
        job_id="j1", created_at=time.time(), model=MODEL, background=False, store=True
    )


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


# --- strings that cannot be encoded ---------------------------------------------------------

LONE = "\ud800"  # json.dumps writes it as the escape \ud800, as a careless client would


def raw_post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as JSON with every non-ASCII character escaped (so a lone surrogate is
    sent as its \\u escape)."""
    content = json.dumps(body) if not isinstance(body, bytes) else body
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


class Stored:
    """What the gateway has stored in Redis for tenant acme: jobs queued, responses open,
    batches, files."""

    def __init__(self, redis_server: RedisServer) -> None:
        self.redis = sync_redis.Redis.from_url(redis_server.url)

    def counts(self) -> tuple[int, ...]:
        return (
            self.redis.zcard(QUEUE),
            self.redis.scard(f"{QUEUE}:responses:open"),
            self.redis.zcard(batches_key(QUEUE, "acme")),
            self.redis.zcard(files_key(QUEUE, "acme")),
        )

    def assert_none_added(self, before: tuple[int, ...]) -> None:
        """Nothing stored since ``before``. A count may fall meanwhile: an earlier test's
        background response, with no worker to answer it, is closed when its stream times out
        (a clean-clone run saw the open responses go from 1 to 0 during a refused request)."""
        after = self.counts()
        assert all(now <= then for now, then in zip(after, before, strict=True)), (before, after)


@pytest.fixture
def stored(redis_server: RedisServer) -> Iterator[Stored]:
    counts = Stored(redis_server)
    yield counts
    counts.redis.close()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def respond(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", **fields}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/responses", respond(metadata={"k": LONE}), "metadata.k"),
        ("/responses", respond(metadata={LONE: "v"}), "metadata.\\ud800"),
        ("/responses", respond(input=f"a{LONE}b"), "input"),
        ("/responses", respond(instructions=LONE), "instructions"),
        ("/responses", respond(input=[{"role": "user", "content": [
            {"type": "input_text", "text": LONE}]}]), "input.0.content.0.text"),
        # found by tests/test_gateway_abuse.py: the refusal of an unknown part quoted its type
        ("/responses", respond(input=[{"role": "user", "content": [
            {"type": LONE, "text": "hi"}]}]), "input.0.content.0.type"),
        ("/chat/completions", chat(messages=[{"role": "user", "content": LONE}]),
         "messages.0.content"),
        ("/chat/completions", chat(user=LONE), "user"),  # a field edgeq ignores, too
        ("/chat/completions", chat(metadata={"k": LONE}), "metadata.k"),
        ("/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                      "completion_window": "24h", "metadata": {"k": LONE}}, "metadata.k"),
        ("/batches", {"input_file_id": LONE, "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"}, "input_file_id"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field_and_nothing_is_stored(
    http: httpx.Client, stored: Stored, path: str, body: dict[str, Any], field: str
) -> None:
    before = stored.counts()
    response = raw_post(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: not valid text: it holds a lone surrogate")
    stored.assert_none_added(before)


def test_a_batch_line_with_a_lone_surrogate_fails_the_batch_naming_the_line(
    acme: openai.OpenAI, stored: Stored
) -> None:
    def line(custom_id: str, content: str) -> bytes:
        body = chat(messages=[{"role": "user", "content": content}])
        item = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
        return json.dumps({**item, "body": body}).encode()

    content = b"\n".join([line("ok", "hi"), line(LONE, "hi"), line("c", f"x{LONE}")]) + b"\n"
    file_id = acme.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
    queued = stored.counts()[0]
    batch = acme.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed"
    assert batch.errors is not None
    problems = [(item.line, item.param) for item in batch.errors.data]
    assert problems == [(2, "custom_id"), (3, "body.messages.0.content")]
    assert stored.counts()[0] == queued  # nothing ran
    assert any(item.id == batch.id for item in acme.batches.list())


def test_a_stored_batch_that_cannot_be_rendered_never_breaks_the_listing(
    redis_server: RedisServer, http: httpx.Client
) -> None:
    # A batch stored before metadata was checked (or by `edgeq batch`, which has no HTTP):
    # its metadata holds a lone surrogate. GET /v1/batches used to answer 500 until it expired.
    settings = GatewaySettings(redis_url=redis_server.url, queue=QUEUE, model=MODEL)

    async def store_one() -> str:
        async with Redis.from_url(redis_server.url) as redis:
            store = BatchStore(redis, settings)
            file = await store.create_file("acme", "in.jsonl", "batch", b'{"custom_id": "a"}\n')
            batch = await store.create_batch("acme", file.id, metadata={"k": f"x{LONE}"})
            return batch.id

    batch_id = asyncio.run(store_one())
    listing = http.get("/batches")
    assert listing.status_code == 200, listing.text
    shown = {item["id"]: item for item in listing.json()["data"]}
    assert shown[batch_id]["metadata"] == {"k": "x\ufffd"}
    assert http.get(f"/batches/{batch_id}").status_code == 200


# --- a request the same as a quarantined one ------------------------------------------------


def test_a_request_the_same_as_a_quarantined_one_is_a_422_the_sdk_does_not_retry(
    redis_server: RedisServer, acme: openai.OpenAI
) -> None:
    # Its quarantine recorded as lua/hand_over.lua's caller records it (tests/test_dead_letter.py
    # quarantines one for real), for the request the gateway makes of this body.
    body = chat(messages=[{"role": "user", "content": "a poison request"}], seed=7)
    fields = ChatCompletionRequest.model_validate(body).edgeq_fields() | {"tenant": "acme"}
    settings = ConnectionSettings(redis_url=redis_server.url, queue=QUEUE)
    payload, _ = job_payload(build_request(fields.pop("messages"), **fields), settings)
    key = poison_refusal_key(QUEUE, request_fingerprint(payload))
    with sync_redis.Redis.from_url(redis_server.url) as redis:
        redis.set(key, "quarantined-job", px=60_000)
        try:
            with pytest.raises(openai.UnprocessableEntityError) as refused:
                acme.chat.completions.create(**body)
            error = refused.value.body
            assert isinstance(error, dict) and error["code"] == "poison_refused"
            assert "quarantined as a poison job (quarantined-job" in error["message"]
            assert "edgeq dead-letter drop quarantined-job" in error["message"]
            assert 0 < int(refused.value.response.headers["Retry-After"]) <= 60
        finally:
            redis.delete(key)


# --- OpenAI's metadata limits -------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "field", "said"),
    [
        ({f"k{n}": "v" for n in range(17)}, "metadata", "at most 16 items"),
        ({"k" * 65: "v"}, f"metadata.{'k' * 65}.[key]", "at most 64 characters"),
        ({"k": "v" * 513}, "metadata.k", "at most 512 characters"),
        ({"k": 1}, "metadata.k", "valid string"),
        ("tags", "metadata", "valid dictionary"),
    ],
)
@pytest.mark.parametrize("path", ["/responses", "/chat/completions", "/batches"])
def test_metadata_past_openais_limits_is_a_400_naming_it(
    http: httpx.Client, stored: Stored, path: str, metadata: Any, field: str, said: str
) -> None:
    body = {
        "/responses": respond(metadata=metadata),
        "/chat/completions": chat(metadata=metadata),
        "/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                     "completion_window": "24h", "metadata": metadata},
    }[path]  # fmt: skip
    before = stored.counts()
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert said in error["message"]
    stored.assert_none_added(before)


def test_sixteen_pairs_at_their_longest_are_taken(http: httpx.Client) -> None:
    metadata = {f"{n:02d}".ljust(64, "k"): "v" * 512 for n in range(16)}
    created = http.post("/responses", json=respond(metadata=metadata, background=True))
    assert created.status_code == 200, created.text
    assert created.json()["metadata"] == metadata
    http.post(f"/responses/{created.json()['id']}/cancel")


# --- strict types, and the field each error names -----------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/chat/completions", chat(max_tokens="10"), "max_tokens"),
        ("/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}),
         "stream_options.include_usage"),
        ("/chat/completions", chat(temperature="0.5"), "temperature"),
        ("/chat/completions", chat(max_tokens=10**6), "max_tokens"),
        ("/chat/completions", chat(max_tokens=0), "max_tokens"),
        ("/chat/completions", chat(temperature=9), "temperature"),
        ("/chat/completions", chat(top_p=2), "top_p"),
        ("/chat/completions", chat(seed=-1), "seed"),
        ("/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]),
         "messages.0.role"),
        ("/chat/completions", chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages.0.content.1"),
        ("/chat/completions", chat(n=2), "n"),
        ("/responses", respond(max_output_tokens="10"), "max_output_tokens"),
        ("/responses", respond(max_output_tokens=10**6), "max_output_tokens"),
        ("/responses", respond(temperature=9), "temperature"),
        ("/responses", respond(top_p=0), "top_p"),
        ("/responses", respond(seed=-1), "seed"),
        ("/responses", respond(stream="yes"), "stream"),
    ],
)  # fmt: skip
def test_a_bad_value_is_a_400_whose_param_names_its_field(
    http: httpx.Client, stored: Stored, path: str, body: dict[str, Any], field: str
) -> None:
    before = stored.counts()
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text
    stored.assert_none_added(before)


@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/batches"])
def test_invalid_json_is_a_400_saying_so_without_a_character_position_as_param(
    http: httpx.Client, path: str
) -> None:
    response = raw_post(http, path, b'{"model": "tiny", "input": ')
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None
    assert error["code"] == "invalid_json"
    assert error["message"].startswith("body: not valid JSON")


@pytest.mark.parametrize(
    ("item", "field", "named"),
    [
        ({"role": "user", "content": [{"type": "input_text", "text": "what is it?"},
                                      {"type": "input_image", "image_url": "https://x/y.png"}]},
         "input.0.content.1", "input_image is not supported"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]},
         "input.0.content.0", "input_file is not supported"),
        ({"type": "reasoning", "summary": []}, "input.0", "'reasoning' items are not supported"),
    ],
)  # fmt: skip
def test_an_input_edgeq_cannot_read_is_refused_by_its_name(
    http: httpx.Client, item: dict[str, Any], field: str, named: str
) -> None:
    response = http.post("/responses", json=respond(input=[item]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported")
    assert error["message"] == f"{field}: {named} by edgeq" + error["message"].split(
        " by edgeq", 1
    )[1]
    assert "union" not in error["message"] and "Input should" not in error["message"]
