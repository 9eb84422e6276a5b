"""The OpenAI-compatible HTTP front: each chat completion becomes one edgeq job.

    HTTP client -> gateway -> ChatClient.submit -> Redis queue -> worker -> engine
                       <- SSE chunks <- the job's pub/sub channel <-

The gateway is a producer like any other service: it holds one pooled ChatClient and no
model. A request waits for its job's first event before answering, so a job the worker
refuses (a prompt too long, a queue deadline passed) still gets a proper HTTP status even when
streaming. A client that goes away cancels its job: the engine stops generating for it.

Each job's tenant (edgeq.core.scheduling) is the one its API key fixes
(EDGEQ_GATEWAY_TENANT_KEYS), else the one the X-Edgeq-Tenant header names, else the client's
EDGEQ_TENANT; its priority class is the body's ``priority`` (openai_api.py).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeq.core.connection import redis_errors
from edgeq.core.errors import (
    EdgeqError,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    QueueFull,
    RedisUnavailable,
)
from edgeq.core.protocol import (
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    StreamEvent,
    dump_json,
)
from edgeq.core.registry import live_workers
from edgeq.core.scheduling import DEFAULT_PRIORITY, TENANT_PATTERN
from edgeq.core.tasks import cancel_and_wait
from edgeq.gateway.openai_api import (
    ChatCompletionRequest,
    ErrorType,
    UnsupportedField,
    chunk_json,
    completion_json,
    error_json,
    logprobs_json,
    now_s,
    tool_calls_json,
    usage_json,
)
from edgeq.gateway.settings import GatewaySettings
from edgeq.producer.client import ChatClient, ChatJob

#: HTTP status for each way a job can end without an answer. OpenAI SDKs retry 429 and 5xx
#: on their own, so only the codes that are safe to retry get a 5xx.
JOB_ERROR_STATUS: dict[str, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.CANCELLED: 499,  # nginx's "client closed request": someone cancelled the job
    ErrorCode.TIMEOUT: 504,
    ErrorCode.SHUTDOWN: 503,
    ErrorCode.EXPIRED: 503,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.ENGINE_ERROR: 500,
}
#: The status nginx logs when the client went away; nobody receives it.
CLIENT_CLOSED_REQUEST = 499
#: How long the list of models the live workers serve is reused before Redis is asked again.
MODEL_NAMES_TTL_S = 2.0
JOB_ID_HEADER = "X-Edgeq-Job-Id"
#: The tenant of a request whose API key fixes none (EDGEQ_GATEWAY_API_KEYS, or no keys).
TENANT_HEADER = "X-Edgeq-Tenant"
SHUTDOWN_REASON = (
    "the gateway shut down before the answer was complete (EDGEQ_GATEWAY_SHUTDOWN_TIMEOUT_S)"
)

log = structlog.get_logger("edgeq.gateway")
T = TypeVar("T")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_json(message, type=type, code=code, param=param)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def job_error(code: str, message: str) -> ApiError:
    status = JOB_ERROR_STATUS.get(code, 500)
    kind: ErrorType = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code)


def client_error(error: EdgeqError, *, retry_after_s: int | None = None) -> ApiError:
    """What ChatClient raised, as the HTTP error a caller of OpenAI expects."""
    if isinstance(error, InvalidRequest):
        return ApiError(400, str(error), type="invalid_request_error", code="invalid_request")
    if isinstance(error, QueueFull):
        return ApiError(
            429,
            str(error),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after_s)} if retry_after_s else None,
        )
    if isinstance(error, JobFailed):
        return job_error(error.code, error.message)
    if isinstance(error, JobTimeout):
        return ApiError(504, str(error), type="server_error", code="stream_timeout")
    if isinstance(error, RedisUnavailable):
        return ApiError(503, str(error), type="service_unavailable", code="redis_unavailable")
    return ApiError(502, str(error), type="server_error", code="stream_broken")


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the HTTP client disconnects first (then ClientGone).

    Starlette does not cancel a handler whose client left, so this listens for ASGI's
    ``http.disconnect`` next to the work, as vLLM's server does.
    """
    work = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone
    finally:
        await cancel_and_wait(work, listener)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ModelNames:
    """The model names the gateway accepts: EDGEQ_MODEL, its aliases, and what live workers
    serve (read from their heartbeats, briefly cached)."""

    def __init__(self, client: ChatClient, settings: GatewaySettings) -> None:
        self._client = client
        self._configured = [settings.model, *settings.gateway_model_aliases]
        self._served: list[str] = []
        self._read_at = float("-inf")

    async def names(self) -> list[str]:
        if time.monotonic() - self._read_at > MODEL_NAMES_TTL_S:
            settings = self._client.settings
            with redis_errors(settings.redis_url):
                workers = await live_workers(self._client.redis, settings.queue)
            self._served = [worker.model for worker in workers]
            self._read_at = time.monotonic()
        return list(dict.fromkeys([*self._configured, *self._served]))


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with ChatClient(settings) as client:
            app.state.client = client
            app.state.models = ModelNames(client, settings)
            yield

    app = FastAPI(
        title="edgeq gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(part) for part in item['loc'][1:]) or 'body'}: {item['msg']}"
            for item in problems
        )
        return ApiError(
            400, message, type="invalid_request_error", code="invalid_request", param=param
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind: ErrorType = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return ApiError(error.status_code, str(error.detail), type=kind).response()

    # Every accepted key with the tenant it fixes (None: a plain EDGEQ_GATEWAY_API_KEYS key).
    api_keys: list[tuple[bytes, str | None]] = [
        *((key.encode(), None) for key in settings.gateway_api_keys),
        *((key.encode(), tenant) for tenant, key in settings.gateway_tenant_keys),
    ]

    async def require_api_key(request: Request) -> str | None:
        """The tenant the caller's key fixes; None for a plain key or when auth is off."""
        if not api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # Compared with every key, so the time taken does not tell which one matched.
        matched = [tenant for key, tenant in api_keys if secrets.compare_digest(given, key)]
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with one of "
                "EDGEQ_GATEWAY_API_KEYS or EDGEQ_GATEWAY_TENANT_KEYS",
                type="authentication_error",
                code="invalid_api_key",
            )
        return matched[0]

    async def request_tenant(
        request: Request, key_tenant: str | None = Depends(require_api_key)
    ) -> str | None:
        """The job's tenant: the key's, else X-Edgeq-Tenant's; None leaves it to EDGEQ_TENANT."""
        named = request.headers.get(TENANT_HEADER)
        if named is not None and not re.fullmatch(TENANT_PATTERN, named):
            shown = repr(named) if len(named) <= 70 else f"{named[:67]!r}..."
            raise ApiError(
                400,
                f"{TENANT_HEADER}: {shown} is not a tenant name (up to 64 letters, digits, "
                f"'_', '.' or '-', starting with a letter or digit)",
                type="invalid_request_error",
                code="invalid_tenant",
            )
        if key_tenant is not None and named is not None and named != key_tenant:
            raise ApiError(
                403,
                f"{TENANT_HEADER}: this API key sends tenant {key_tenant!r}'s requests "
                f"(EDGEQ_GATEWAY_TENANT_KEYS), not {named!r}'s; leave the header out or "
                f"use {named!r}'s key",
                type="permission_error",
                code="tenant_mismatch",
            )
        return key_tenant or named

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up (say nothing about Redis or workers: that is /ready)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Redis answers and at least one warm worker serves the queue."""
        client: ChatClient = request.app.state.client
        try:
            with redis_errors(settings.redis_url):
                await client.redis.ping()
                workers = await live_workers(client.redis, settings.queue)
        except RedisUnavailable as error:
            return JSONResponse({"status": "unavailable", "reason": str(error)}, status_code=503)
        warm = [worker for worker in workers if worker.state == "ready"]
        if not warm:
            reason = f"no warm worker serves queue {settings.queue}"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "workers": len(warm), "queue": settings.queue})

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models(request: Request) -> dict[str, Any]:
        try:
            names = await request.app.state.models.names()
        except RedisUnavailable as error:
            raise client_error(error) from None
        created = now_s()
        data = [{"id": name, "object": "model", "created": created, "owned_by": "edgeq"}
                for name in names]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        tenant: str | None = Depends(request_tenant),
    ) -> Response:
        client: ChatClient = request.app.state.client
        started = time.monotonic()
        try:
            names = await request.app.state.models.names()
            if body.model not in names:
                raise ApiError(
                    404,
                    f"the model {body.model!r} does not exist here; this gateway serves "
                    f"{', '.join(names)} (EDGEQ_MODEL, EDGEQ_GATEWAY_MODEL_ALIASES)",
                    type="not_found_error",
                    code="model_not_found",
                    param="model",
                )
            fields = body.edgeq_fields()
            if tenant is not None:
                fields["tenant"] = tenant
            job = await client.submit(fields.pop("messages"), **fields)
        except UnsupportedField as error:
            raise ApiError(
                400, str(error), type="invalid_request_error", code=error.code, param=error.param
            ) from None
        except EdgeqError as error:
            raise client_error(error, retry_after_s=settings.gateway_retry_after_s) from None
        bound = log.bind(
            job_id=job.job_id,
            stream=body.stream,
            tenant=tenant or client.settings.tenant,
            priority=fields.get("priority", DEFAULT_PRIORITY),
        )
        headers = {JOB_ID_HEADER: job.job_id}
        events = job.stream()
        try:
            first = await until_disconnected(request, anext(events))
            if isinstance(first, ErrorEvent):
                raise JobFailed(job.job_id, first.code, first.message)
            if not body.stream:
                result = await until_disconnected(request, _rest_of_answer(job, events))
        except ClientGone:
            await _cancel(job, "the HTTP client disconnected")
            bound.info("gateway_client_gone", waited_ms=_ms_since(started))
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except JobFailed as error:
            await job.aclose()  # the stream has ended; stop listening now, not at GC
            failure = client_error(error)
            failure.headers = headers
            bound.info("gateway_job_failed", status=failure.status, code=error.code)
            raise failure from None
        except EdgeqError as error:
            await _cancel(job, f"the gateway lost the job's stream: {error}")
            raise client_error(error) from None
        except asyncio.CancelledError:  # the server stopped waiting (shutdown timeout)
            await _cancel(job, SHUTDOWN_REASON)
            raise
        except Exception as error:  # a bug of ours: the client gets a 500, the job must end
            await _cancel(job, f"the gateway failed: {type(error).__name__}")
            raise
        if not body.stream:
            bound.info("gateway_done", total_ms=_ms_since(started))
            return JSONResponse(
                completion_json(result, model=body.model, created=now_s()), headers=headers
            )
        shutdown = anyio.Event()
        return EventSourceResponse(
            _sse_chunks(job, first, events, body, started, bound, shutdown),
            headers=headers,
            sep="\n",
            # On SIGTERM a stream may still finish for this long, then its job is cancelled.
            shutdown_event=shutdown,
            shutdown_grace_period=settings.gateway_shutdown_timeout_s,
        )

    return app


async def _rest_of_answer(job: ChatJob, events: AsyncIterator[StreamEvent]) -> ChatResult:
    async for _ in events:  # the job collects the text as its stream is read
        pass
    return await job.result()


async def _sse_chunks(
    job: ChatJob,
    first: StreamEvent,
    events: AsyncIterator[StreamEvent],
    body: ChatCompletionRequest,
    started: float,
    bound: Any,
    shutdown: anyio.Event,
) -> AsyncIterator[ServerSentEvent]:
    """OpenAI's chunk sequence: role, content deltas, the finish chunk, the usage chunk if
    asked, ``[DONE]``. An error after the first event is sent as an ``error`` chunk, which
    OpenAI SDKs raise as APIError."""
    created = now_s()

    def chunk(**fields: Any) -> ServerSentEvent:
        payload = chunk_json(job.job_id, model=body.model, created=created, **fields)
        return ServerSentEvent(data=dump_json(payload).decode())

    unfinished_because: str | None = "the HTTP client disconnected"
    try:
        yield chunk(delta={"role": "assistant", "content": ""})
        event: StreamEvent = first
        while True:
            if isinstance(event, DeltaEvent):
                if event.text:
                    yield chunk(delta={"content": event.text})
            elif isinstance(event, DoneEvent):
                unfinished_because = None
                if event.reasoning is not None:
                    yield chunk(delta={"reasoning_content": event.reasoning})
                if event.tool_calls:  # final-only: every call whole, in one chunk
                    yield chunk(
                        delta={"tool_calls": tool_calls_json(event.tool_calls, streamed=True)}
                    )
                yield chunk(finish_reason=event.finish_reason, logprobs=logprobs_json(event))
                if body.include_usage:
                    yield chunk(usage=usage_json(event))
                bound.info("gateway_done", total_ms=_ms_since(started))
                break
            else:
                unfinished_because = None
                failure = job_error(event.code, event.message)
                yield ServerSentEvent(data=dump_json(failure.body).decode())
                bound.info("gateway_job_failed", status=failure.status, code=event.code)
                break
            event = await anext(events)
    except EdgeqError as error:
        unfinished_because = f"the gateway lost the job's stream: {error}"
        yield ServerSentEvent(data=dump_json(client_error(error).body).decode())
    finally:
        if unfinished_because:  # nobody will read the rest: stop generating it
            if shutdown.is_set():
                unfinished_because = SHUTDOWN_REASON
            await _cancel(job, unfinished_because)
            bound.info("gateway_job_unfinished", reason=unfinished_because)
        with anyio.CancelScope(shield=True):
            await job.aclose()  # its pub/sub connection goes back now, not at GC
    yield ServerSentEvent(data="[DONE]")


async def _cancel(job: ChatJob, reason: str) -> None:
    """Cancel the job even while this task is itself being cancelled (a closed connection)."""
    with anyio.CancelScope(shield=True):
        try:
            await job.cancel(reason)
        except EdgeqError as error:
            log.warning("gateway_cancel_failed", error=str(error))


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)
