"""The gateway's rooms, each alone: no whole app, no Redis, no engine.

Each test builds the smallest thing a room plugs into (a FastAPI app holding only the router
or dependency under test, a fake ChatClient or job) and checks what an OpenAI client relies on:
the status, the error body, the headers, the streamed chunks, and that a job nobody will read
is cancelled. tests/test_gateway.py checks the whole gateway against a real worker.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import redis.exceptions
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from edgeq.core.errors import (
    EdgeqError,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    QueueFull,
    RedisUnavailable,
    StreamBroken,
)
from edgeq.core.protocol import (
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    StreamEvent,
    Timings,
    Usage,
)
from edgeq.core.structured import FunctionCall, ToolCall
from edgeq.gateway import chat, models, probes
from edgeq.gateway.app import create_app
from edgeq.gateway.auth import TENANT_HEADER, TenantDep
from edgeq.gateway.errors import ApiError, client_error, install_error_handlers
from edgeq.gateway.jobs import JOB_ID_HEADER, SHUTDOWN_REASON
from edgeq.gateway.settings import GatewaySettings
from edgeq.gateway.sse import sse_chunks
from edgeq.gateway.state import GatewayState, set_settings, set_state

pytestmark = pytest.mark.usefixtures("clean_edgeq_env")

JOB = "job-1"
MODEL = "Qwen/Qwen3-0.6B"
CREATED = 1_700_000_000


def settings(**fields: Any) -> GatewaySettings:
    return GatewaySettings(model=MODEL, **fields)


def app_with(
    gateway_settings: GatewaySettings, *routers: Any, client: Any = None, names: Any = None
) -> FastAPI:
    """An app holding only ``routers``, the error handlers and the state they read."""
    app = FastAPI()
    set_settings(app, gateway_settings)
    # Only what the routers under test read; the rest is never asked for.
    set_state(app, GatewayState(client, names, None, None, None))  # type: ignore[arg-type]
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    return app


def openai_error(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- auth.py: the API key and the tenant --------------------------------------------------


def tenant_app(gateway_settings: GatewaySettings) -> TestClient:
    app = app_with(gateway_settings)

    @app.get("/tenant")
    async def tenant_of(tenant: TenantDep) -> dict[str, str | None]:
        return {"tenant": tenant}

    return TestClient(app)


def test_without_keys_every_request_is_let_in_with_the_tenant_its_header_names() -> None:
    http = tenant_app(settings())
    assert http.get("/tenant").json() == {"tenant": None}  # the client's EDGEQ_TENANT
    assert http.get("/tenant", headers={TENANT_HEADER: "nightly"}).json() == {"tenant": "nightly"}


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", "Basic sk-plain", "sk-plain", "Bearer "]
)
def test_a_missing_or_wrong_key_is_a_401_in_openai_shape(authorization: str | None) -> None:
    http = tenant_app(settings(gateway_api_keys="sk-plain", gateway_tenant_keys="nightly=sk-n"))
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = http.get("/tenant", headers=headers)
    assert response.status_code == 401
    assert response.json() == openai_error(
        "missing or wrong API key: send 'Authorization: Bearer <key>' with one of "
        "EDGEQ_GATEWAY_API_KEYS or EDGEQ_GATEWAY_TENANT_KEYS",
        "authentication_error",
        "invalid_api_key",
    )


def test_a_tenant_key_fixes_the_tenant_and_a_plain_key_leaves_it_to_the_header() -> None:
    http = tenant_app(settings(gateway_api_keys="sk-plain", gateway_tenant_keys="nightly=sk-n"))
    plain, nightly = {"Authorization": "Bearer sk-plain"}, {"Authorization": "bearer sk-n"}
    assert http.get("/tenant", headers=plain).json() == {"tenant": None}
    assert http.get("/tenant", headers={**plain, TENANT_HEADER: "a"}).json() == {"tenant": "a"}
    assert http.get("/tenant", headers=nightly).json() == {"tenant": "nightly"}
    same = {**nightly, TENANT_HEADER: "nightly"}
    assert http.get("/tenant", headers=same).json() == {"tenant": "nightly"}

    response = http.get("/tenant", headers={**nightly, TENANT_HEADER: "support"})
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "permission_error"
    assert response.json()["error"]["code"] == "tenant_mismatch"
    assert "'nightly'" in response.json()["error"]["message"]


def test_a_header_that_names_no_tenant_is_a_400_showing_at_most_70_characters() -> None:
    http = tenant_app(settings())
    response = http.get("/tenant", headers={TENANT_HEADER: "-dash-first"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_tenant"
    assert response.json()["error"]["message"].startswith(f"{TENANT_HEADER}: '-dash-first' is")
    long = http.get("/tenant", headers={TENANT_HEADER: "x" * 65}).json()["error"]["message"]
    assert f"'{'x' * 65}' is not a tenant name" in long  # short enough to show whole
    longer = http.get("/tenant", headers={TENANT_HEADER: "y" * 200}).json()["error"]["message"]
    assert f"'{'y' * 67}'... is not a tenant name" in longer


# --- errors.py: edgeq's errors and FastAPI's, in OpenAI's shape ---------------------------


@pytest.mark.parametrize(
    ("error", "status", "type", "code"),
    [
        (InvalidRequest("temperature: too hot"), 400, "invalid_request_error", "invalid_request"),
        (JobFailed(JOB, "prompt_too_long", "too long"), 400, "invalid_request_error",
         "prompt_too_long"),
        (JobFailed(JOB, "cancelled", "by someone"), 499, "invalid_request_error", "cancelled"),
        (JobFailed(JOB, "worker_lost", "gone"), 503, "server_error", "worker_lost"),
        (JobFailed(JOB, "expired", "waited too long"), 503, "server_error", "expired"),
        (JobFailed(JOB, "engine_error", "boom"), 500, "server_error", "engine_error"),
        (JobFailed(JOB, "poison_job", "two engines"), 422, "invalid_request_error",
         "poison_job"),
        (JobFailed(JOB, "a_new_code", "?"), 500, "server_error", "a_new_code"),
        (JobTimeout(JOB, 30, "is a worker running?"), 504, "server_error", "stream_timeout"),
        (RedisUnavailable("cannot reach Redis"), 503, "service_unavailable",
         "redis_unavailable"),
        (StreamBroken("a gap in seq"), 502, "server_error", "stream_broken"),
    ],
)  # fmt: skip
def test_each_client_error_gets_the_status_an_openai_sdk_retries_or_not(
    error: EdgeqError, status: int, type: str, code: str
) -> None:
    api_error = client_error(error, retry_after_s=5)
    assert api_error.status == status
    # A failed job's body carries its own sentence, not JobFailed's prefixed one.
    message = error.message if isinstance(error, JobFailed) else str(error)
    # An invalid request's message starts with the field at fault: that is its param.
    param = "temperature" if isinstance(error, InvalidRequest) else None
    assert api_error.body == openai_error(message, type, code, param)
    assert api_error.headers is None  # only a full queue says when to come back


def test_a_full_queue_is_a_429_that_says_when_to_retry() -> None:
    app = app_with(settings())

    @app.get("/full")
    async def full() -> None:
        raise client_error(QueueFull("the queue holds 100 jobs"), retry_after_s=3)

    response = TestClient(app).get("/full")
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "3"
    assert response.json() == openai_error(
        "the queue holds 100 jobs", "rate_limit_error", "queue_full"
    )


class Body(BaseModel):
    model: str
    max_tokens: int


def test_fastapis_own_errors_are_answered_in_openai_shape() -> None:
    app = app_with(settings())

    @app.post("/body")
    async def takes_body(body: Body) -> dict[str, str]:
        return {"model": body.model}

    http = TestClient(app)
    response = http.post("/body", json={"max_tokens": "many"})
    assert response.status_code == 400  # not FastAPI's 422: OpenAI SDKs know 400
    assert response.json() == openai_error(
        "model: Field required; max_tokens: Input should be a valid integer, unable to parse "
        "string as an integer",
        "invalid_request_error",
        "invalid_request",
        param="model",
    )
    assert http.get("/nowhere").status_code == 404
    assert http.get("/nowhere").json() == openai_error("Not Found", "not_found_error")
    assert http.get("/body").status_code == 405
    assert http.get("/body").json() == openai_error("Method Not Allowed", "invalid_request_error")


# --- sse.py: a job's events as OpenAI's chunks ----------------------------------------------


class FakeJob:
    """A ChatJob as far as the gateway goes: its id, its stream, cancel and close."""

    def __init__(self, events: list[StreamEvent] | None = None, *, fail: EdgeqError | None = None):
        self.job_id = JOB
        self.events = events or []
        self.fail = fail
        self.cancelled: list[str] = []
        self.closed = 0

    async def stream(self) -> AsyncIterator[StreamEvent]:
        for event in self.events:
            yield event
            if not isinstance(event, DeltaEvent):
                return  # a terminal event ends the stream, as ChatJob's does
        if self.fail is not None:
            raise self.fail
        await anyio.sleep_forever()  # a job that has not ended yet

    async def result(self) -> ChatResult:
        done = self.events[-1]
        assert isinstance(done, DoneEvent)
        text = "".join(event.text for event in self.events if isinstance(event, DeltaEvent))
        return ChatResult.from_done(done, text)

    async def cancel(self, reason: str = "cancelled by the client") -> bool:
        self.cancelled.append(reason)
        return True

    async def aclose(self) -> None:
        self.closed += 1


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def delta(seq: int, text: str) -> DeltaEvent:
    return DeltaEvent(job_id=JOB, seq=seq, text=text)


def done(seq: int, **fields: Any) -> DoneEvent:
    return DoneEvent(
        job_id=JOB,
        seq=seq,
        finish_reason=fields.pop("finish_reason", "stop"),
        usage=Usage(prompt_tokens=7, completion_tokens=3),
        timings=Timings(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0),
        **fields,
    )


def chunk(created: int, **choice: Any) -> dict[str, Any]:
    """The chunk OpenAI streams, spelled out (not built with the code under test)."""
    return {
        "id": f"chatcmpl-{JOB}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, **choice}],
    }


def stream_of(
    job: FakeJob, *, include_usage: bool = False, log: Log | None = None, **kw: Any
) -> AsyncIterator[ServerSentEvent]:
    events = job.stream()
    first = job.events[0] if job.events else None
    return sse_chunks(
        job,
        first,  # type: ignore[arg-type]
        _after_first(events) if first is not None else events,
        model=MODEL,
        include_usage=include_usage,
        started=0.0,
        log=log or Log(),
        shutdown=kw.get("shutdown", anyio.Event()),
    )


async def _after_first(events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    await anext(events)  # the route read the first event itself
    async for event in events:
        yield event


def data_of(sent: list[ServerSentEvent]) -> list[Any]:
    return [event.data if event.data == "[DONE]" else json.loads(event.data) for event in sent]


async def test_a_finished_job_streams_role_deltas_reasoning_tool_calls_finish_and_usage() -> None:
    call = ToolCall(id="call-1", function=FunctionCall(name="f", arguments='{"a": 1}'))
    job = FakeJob(
        [delta(0, "Hel"), delta(1, ""), delta(2, "lo"),
         done(3, reasoning="thought", tool_calls=[call], finish_reason="tool_calls")]
    )  # fmt: skip
    log = Log()
    sent = data_of([event async for event in stream_of(job, include_usage=True, log=log)])
    created = sent[0]["created"]
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    tool_call = {"index": 0, "id": "call-1", "type": "function",
                 "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    assert sent == [
        chunk(created, delta={"role": "assistant", "content": ""}),
        chunk(created, delta={"content": "Hel"}),  # an empty delta sends nothing
        chunk(created, delta={"content": "lo"}),
        chunk(created, delta={"reasoning_content": "thought"}),
        chunk(created, delta={"tool_calls": [tool_call]}),
        chunk(created, finish_reason="tool_calls"),
        {**chunk(created), "choices": [], "usage": usage},
        "[DONE]",
    ]
    assert job.cancelled == []  # read to its end: nothing to stop
    assert job.closed == 1  # its pub/sub connection goes back at once
    assert log.names() == ["gateway_done"]


async def test_without_include_usage_there_is_no_usage_chunk() -> None:
    sent = data_of([event async for event in stream_of(FakeJob([delta(0, "a"), done(1)]))])
    assert [item["choices"][0]["finish_reason"] for item in sent[:-1]] == [None, None, "stop"]
    assert sent[-1] == "[DONE]"


async def test_a_job_failing_mid_stream_sends_its_error_as_a_chunk_then_done() -> None:
    failed = ErrorEvent(job_id=JOB, seq=1, code="worker_lost", message="the worker died")
    job, log = FakeJob([delta(0, "a"), failed]), Log()
    sent = data_of([event async for event in stream_of(job, log=log)])
    assert sent[2:] == [openai_error("the worker died", "server_error", "worker_lost"), "[DONE]"]
    assert job.cancelled == []  # it has already ended
    assert log.events == [("gateway_job_failed", {"status": 503, "code": "worker_lost"})]


async def test_a_lost_stream_sends_an_error_chunk_and_cancels_the_job() -> None:
    lost = JobTimeout(JOB, 30, "is a worker running?")
    job = FakeJob([delta(0, "a")], fail=lost)
    sent = data_of([event async for event in stream_of(job)])
    assert sent[2:] == [openai_error(str(lost), "server_error", "stream_timeout"), "[DONE]"]
    assert job.cancelled == [f"the gateway lost the job's stream: {lost}"]
    assert job.closed == 1


@pytest.mark.parametrize("shutting_down", [False, True])
async def test_a_stream_nobody_reads_to_its_end_cancels_its_job(shutting_down: bool) -> None:
    shutdown = anyio.Event()
    job, log = FakeJob([delta(0, "a")]), Log()
    chunks = stream_of(job, log=log, shutdown=shutdown)
    assert data_of([await anext(chunks), await anext(chunks)])[1]["choices"][0]["delta"] == {
        "content": "a"
    }
    if shutting_down:
        shutdown.set()
    await chunks.aclose()  # what sse-starlette does when the client leaves or time is up
    reason = SHUTDOWN_REASON if shutting_down else "the HTTP client disconnected"
    assert job.cancelled == [reason]
    assert log.events == [("gateway_job_unfinished", {"reason": reason})]
    assert job.closed == 1


# --- models.py and probes.py ----------------------------------------------------------------


class FakeNames:
    def __init__(self, names: list[str] | None = None, *, fail: EdgeqError | None = None):
        self._names, self._fail, self.asked = names or [MODEL], fail, 0

    async def names(self) -> list[str]:
        self.asked += 1
        if self._fail is not None:
            raise self._fail
        return self._names

    async def adapters(self) -> list[str]:  # no LoRA adapter here (tests/test_adapters.py)
        return []


def test_models_lists_every_name_and_needs_a_key_before_it_asks_redis() -> None:
    names = FakeNames([MODEL, "qwen-small"])
    http = TestClient(app_with(settings(gateway_api_keys="sk-plain"), models.router, names=names))
    assert http.get("/v1/models").status_code == 401
    assert names.asked == 0
    listed = http.get("/v1/models", headers={"Authorization": "Bearer sk-plain"}).json()
    assert listed["object"] == "list"
    assert [(item["id"], item["object"], item["owned_by"]) for item in listed["data"]] == [
        (MODEL, "model", "edgeq"),
        ("qwen-small", "model", "edgeq"),
    ]


def test_models_without_redis_is_a_503() -> None:
    names = FakeNames(fail=RedisUnavailable("cannot reach Redis at redis://x"))
    response = TestClient(app_with(settings(), models.router, names=names)).get("/v1/models")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "redis_unavailable"


class DownRedis:
    async def ping(self) -> None:
        raise redis.exceptions.ConnectionError("Connection refused")


def test_health_says_up_and_ready_says_why_not_without_an_api_key() -> None:
    client = SimpleNamespace(redis=DownRedis())
    gateway = settings(gateway_api_keys="sk-plain", redis_url="redis://127.0.0.1:1/0")
    http = TestClient(app_with(gateway, probes.router, client=client))
    assert http.get("/health").json() == {"status": "ok"}
    response = http.get("/ready")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "reason": "cannot reach Redis at redis://127.0.0.1:1/0: Connection refused",
    }


# --- chat.py: a chat completion is one job --------------------------------------------------


class FakeClient:
    """A ChatClient that enqueues nothing: it records what it was asked, and answers with
    ``job`` or raises ``refuse``."""

    def __init__(self, job: FakeJob | None = None, *, refuse: EdgeqError | None = None):
        self.job, self.refuse = job, refuse
        self.settings = SimpleNamespace(tenant="default")
        self.submitted: list[dict[str, Any]] = []

    async def submit(self, messages: list[Any], **fields: Any) -> FakeJob:
        self.submitted.append({"messages": messages, **fields})
        if self.refuse is not None:
            raise self.refuse
        assert self.job is not None
        return self.job


@pytest.fixture
def chat_app() -> Iterator[Any]:
    def make(client: FakeClient, **fields: Any) -> TestClient:
        gateway = settings(gateway_retry_after_s=7, **fields)
        app = app_with(gateway, chat.router, client=client, names=FakeNames())
        return TestClient(app)

    yield make


def ask(http: TestClient, *, headers: dict[str, str] | None = None, **body: Any) -> Any:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    return http.post("/v1/chat/completions", json=request, headers=headers)


def test_a_model_not_served_here_is_a_404_and_nothing_is_enqueued(chat_app: Any) -> None:
    client = FakeClient()
    response = ask(chat_app(client), model="gpt-4o")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "model"
    assert client.submitted == []


def test_a_field_edgeq_cannot_honour_is_a_400_naming_it(chat_app: Any) -> None:
    client = FakeClient()
    response = ask(chat_app(client), n=2)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported"
    assert response.json()["error"]["message"].startswith("n: ")
    assert client.submitted == []


def test_a_full_queue_answers_429_with_the_configured_retry_after(chat_app: Any) -> None:
    response = ask(chat_app(FakeClient(refuse=QueueFull("the queue is full"))))
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "7"
    assert response.json() == openai_error("the queue is full", "rate_limit_error", "queue_full")


def test_a_job_the_worker_refuses_gets_its_status_and_job_id(chat_app: Any) -> None:
    refused = ErrorEvent(job_id=JOB, seq=0, code="prompt_too_long", message="too long")
    job = FakeJob([refused])
    response = ask(chat_app(FakeClient(job)), stream=True)
    assert response.status_code == 400  # even streaming: nothing was sent yet
    assert response.headers[JOB_ID_HEADER] == JOB
    assert response.json() == openai_error("too long", "invalid_request_error", "prompt_too_long")
    assert job.cancelled == [] and job.closed == 1


def test_an_answer_is_one_completion_sent_as_the_tenant_the_header_names(chat_app: Any) -> None:
    client = FakeClient(FakeJob([delta(0, "Hel"), delta(1, "lo"), done(2)]))
    response = ask(chat_app(client), headers={TENANT_HEADER: "nightly"}, priority="batch")
    assert response.status_code == 200
    assert response.headers[JOB_ID_HEADER] == JOB
    answer = response.json()
    assert answer["id"] == f"chatcmpl-{JOB}" and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    [submitted] = client.submitted
    assert submitted["tenant"] == "nightly" and submitted["priority"] == "batch"
    assert submitted["messages"] == [{"role": "user", "content": "hi"}]


def test_a_streamed_answer_is_server_sent_chunks_ending_in_done(chat_app: Any) -> None:
    job = FakeJob([delta(0, "Hi"), done(1)])
    response = ask(chat_app(FakeClient(job)), stream=True)
    assert response.status_code == 200
    assert response.headers[JOB_ID_HEADER] == JOB
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    sent = [line.removeprefix("data: ") for line in lines]
    assert sent[-1] == "[DONE]"
    contents = [json.loads(item)["choices"][0]["delta"].get("content") for item in sent[:-1]]
    assert contents == ["", "Hi", None]
    assert job.cancelled == []


def test_an_api_error_raised_anywhere_keeps_its_status_body_and_headers() -> None:
    error = ApiError(418, "short and stout", type="invalid_request_error", headers={"X-A": "b"})
    app = app_with(settings())

    @app.get("/teapot")
    async def teapot() -> None:
        raise error

    response = TestClient(app).get("/teapot")
    assert (response.status_code, response.headers["X-A"]) == (418, "b")
    assert response.json() == openai_error("short and stout", "invalid_request_error")


# --- app.py: the rooms joined ---------------------------------------------------------------


def test_create_app_joins_every_room_without_touching_redis_until_its_lifespan() -> None:
    # Not entered as a context manager: the lifespan (the ChatClient) never starts.
    http = TestClient(create_app(settings(gateway_api_keys="sk-plain")))
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/nowhere").json() == openai_error("Not Found", "not_found_error")
    assert http.get("/v1/models").status_code == 401
    assert ask(http).status_code == 401
    assert http.get("/docs").status_code == 404  # no API docs served to whoever asks
