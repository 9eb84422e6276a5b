"""``/v1/responses``: OpenAI's Responses API, each response one edgeq chat job.

    POST   /v1/responses                 create (stream, background, store, previous_response_id)
    GET    /v1/responses/{id}            the response now; ``?stream=true&starting_after=N``
                                         replays its events after N, then follows it live
    POST   /v1/responses/{id}/cancel     cancel its job
    DELETE /v1/responses/{id}            forget it (and cancel its job if it still runs)

The gateway keeps no state: a stored response is its request in Redis and its job's events
(edgeq.resources.responses.store); its stream is computed from them
(edgeq.resources.responses.events), so any gateway
process serves any response, and a stream resumes at the event after ``starting_after`` after
the client, the gateway, a worker or Redis (with AOF) went away. A stored response belongs to
the tenant that created it: another tenant gets 404, as for an id that does not exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import structlog
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from edgeq.core.errors import EdgeqError
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, dump_json
from edgeq.gateway.auth import KeyNameDep, TenantDep
from edgeq.gateway.errors import ApiError, client_error, job_error
from edgeq.gateway.jobs import (
    CLIENT_CLOSED_REQUEST,
    JOB_ID_HEADER,
    ClientGone,
    cancel_job,
    submit_job,
    until_disconnected,
)
from edgeq.gateway.state import (
    ClientDep,
    FollowerDep,
    ModelNamesDep,
    ResponseStoreDep,
    SettingsDep,
)
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.resources.model_names import ModelNames
from edgeq.resources.openai_api import ChatCompletionRequest, UnsupportedField
from edgeq.resources.responses.events import (
    TERMINAL_STATUSES,
    ResponseEvents,
    ResponseState,
    error_event,
    final_state,
    job_id_of,
    response_json,
)
from edgeq.resources.responses.follower import ResponseFollower
from edgeq.resources.responses.request import CreateResponse
from edgeq.resources.responses.store import ResponseStore, StoredResponse

log = structlog.get_logger("edgeq.gateway")
router = APIRouter()

#: How the chat request (whose errors name its fields) spells a Responses field.
RENAMED_FIELDS = (
    ("response_format.json_schema.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
)

# --- helpers ---------------------------------------------------------------------------------


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404 if param is None else 400,
        f"{param + ': ' if param else ''}no response with id {response_id!r} (it was never "
        f"stored, was deleted, expired after EDGEQ_GATEWAY_RESPONSE_TTL_S, or belongs to "
        f"another tenant)",
        type="not_found_error" if param is None else "invalid_request_error",
        code="response_not_found",
        param=param,
    )


async def load_owned(
    store: ResponseStore,
    response_id: str,
    tenant: str,
    *,
    param: str | None = None,
) -> tuple[StoredResponse, list[DeltaEvent | DoneEvent | ErrorEvent] | None]:
    """The stored response if ``tenant`` owns it; else the same error as for no response."""
    job_id = job_id_of(response_id)
    loaded = None if job_id is None else await store.load(job_id)
    if loaded is None or loaded[0].tenant != tenant:
        raise not_found(response_id, param)
    return loaded


def tenant_of(tenant: str | None, client: ChatClient) -> str:
    return tenant or client.settings.tenant


async def current_state(
    store: ResponseStore, request: StoredResponse, stored: list[Any] | None
) -> ResponseState:
    events = await store.events(request.job_id, stored)
    return final_state(request, events)


def sse(event: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(event=event["type"], data=dump_json(event).decode())


# --- routes ----------------------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(
    request: Request,
    body: CreateResponse,
    tenant: TenantDep,
    key_name: KeyNameDep,
    client: ClientDep,
    models: ModelNamesDep,
    settings: SettingsDep,
    store: ResponseStoreDep,
    follower: FollowerDep,
) -> Response:
    owner = tenant_of(tenant, client)
    if body.background and not body.store:
        raise ApiError(
            400,
            "background: a background response must be stored; send store=true or leave it out",
            type="invalid_request_error",
            code="invalid_request",
            param="background",
        )
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = await _conversation_of(store, body.previous_response_id, owner)
    chat_body = _chat_body(body, history)
    job = await _submit(
        client, models, chat_body, tenant, settings.gateway_retry_after_s, key_name
    )
    record = body.stored(job.job_id, owner, history)
    bound = log.bind(job_id=job.job_id, stream=body.stream, background=body.background)
    if body.store:
        await _store(job, record, store, follower, bound)
    headers = {JOB_ID_HEADER: job.job_id}
    if body.stream:
        bound.info("response_streaming")
        return EventSourceResponse(
            _live(job, record, starting_after=-1, cancel_on_leave=not body.background),
            headers=headers,
            sep="\n",
        )
    if body.background:
        await job.aclose()
        bound.info("response_background")
        state = ResponseState(status="queued")
        return JSONResponse(response_json(record, state), headers=headers)
    state = await _answer(request, job, record)
    if state is None:  # the client left: its job is cancelled
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    bound.info("response_done", status=state.status)
    return JSONResponse(response_json(record, state), headers=headers)


def _chat_body(body: CreateResponse, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion a response asks for: its instructions, the conversation it
    continues and its input."""
    messages = history + body.messages()
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    try:
        fields = body.chat_fields()
    except UnsupportedField as error:  # a field the chat request has no place for
        raise ApiError(
            400, str(error), type="invalid_request_error", code=error.code, param=error.param
        ) from None
    try:
        return ChatCompletionRequest.model_validate(
            {"model": body.model, "messages": messages, **fields}
        )
    except ValueError as error:
        raise ApiError(
            400, str(error), type="invalid_request_error", code="invalid_request"
        ) from None


async def _submit(
    client: ChatClient,
    models: ModelNames,
    chat_body: ChatCompletionRequest,
    tenant: str | None,
    retry_after_s: int,
    key_name: str | None,
) -> ChatJob:
    try:
        job, _ = await submit_job(
            client, models, chat_body, tenant, retry_after_s, key_name=key_name
        )
    except ApiError as error:  # named as the chat request spells them: say it the Responses way
        fields = error.body["error"]
        for chat_name, name in RENAMED_FIELDS:
            fields["message"] = fields["message"].replace(chat_name, name)
            if fields["param"] is not None:
                fields["param"] = fields["param"].replace(chat_name, name)
        raise
    return job


async def _store(
    job: ChatJob,
    record: StoredResponse,
    store: ResponseStore,
    follower: ResponseFollower,
    bound: structlog.typing.FilteringBoundLogger,
) -> None:
    """Store the response and follow it from this process (any other may take it over)."""
    try:
        await store.save(record)
    except Exception:  # the caller gets no id: the job must not run for nobody
        await cancel_job(job, "the gateway could not store the response")
        await job.aclose()
        raise
    try:
        await follower.adopt(job.job_id)
    except Exception as error:  # Redis away: the next scan of any gateway adopts it
        bound.warning("response_adopt_failed", error=f"{type(error).__name__}: {error}")


async def _answer(request: Request, job: ChatJob, record: StoredResponse) -> ResponseState | None:
    """The ended response's state, read from its job's stream while the client waits; None
    if the client left first (the job is cancelled then)."""
    mapper = ResponseEvents(record)
    try:
        await until_disconnected(request, _follow(job, mapper))
    except ClientGone:
        await cancel_job(job, "the HTTP client disconnected")
        return None
    except EdgeqError as error:
        await cancel_job(job, f"the gateway lost the job's stream: {error}")
        raise client_error(error) from None
    error = mapper.state.error
    if error is not None and not mapper.state.text and error.code != "cancelled":
        raise job_error(error.code, error.message)  # refused: a status, as the chat path
    return mapper.state


async def _follow(job: ChatJob, mapper: ResponseEvents) -> None:
    async for event in job.stream():
        mapper.feed(event)


async def _conversation_of(
    store: ResponseStore, previous_id: str, tenant: str
) -> list[dict[str, Any]]:
    request, stored = await load_owned(store, previous_id, tenant, param="previous_response_id")
    state = await current_state(store, request, stored)
    if state.status not in TERMINAL_STATUSES:
        raise ApiError(
            400,
            f"previous_response_id: response {previous_id!r} is still {state.status}; "
            f"continue from it once it has ended",
            type="invalid_request_error",
            code="response_in_progress",
            param="previous_response_id",
        )
    answer: dict[str, Any] = {"role": "assistant", "content": state.output_text}
    if state.done is not None and state.done.tool_calls:
        answer["tool_calls"] = [call.model_dump(mode="json") for call in state.done.tool_calls]
    return [*request.messages, answer]


async def _live(
    job: ChatJob | None,
    record: StoredResponse,
    *,
    starting_after: int,
    cancel_on_leave: bool,
    stored: list[DeltaEvent | DoneEvent | ErrorEvent] | None = None,
) -> AsyncIterator[ServerSentEvent]:
    """The response's stream events after ``starting_after``: the job's events from its first
    (replayed from Redis), numbered by ResponseEvents, then live until its terminal event;
    with ``stored`` (an ended response's kept events), those and no job."""
    mapper = ResponseEvents(record)
    ended = False
    try:
        for event in mapper.opening():
            if event["sequence_number"] > starting_after:
                yield sse(event)
        source = job.stream() if job is not None else _replayed(stored or [])
        async for job_event in source:
            for event in mapper.feed(job_event):
                if event["sequence_number"] > starting_after:
                    yield sse(event)
            if isinstance(job_event, DoneEvent | ErrorEvent):
                ended = True
                break
    except EdgeqError as error:
        # Not one of the response's events: it carries the number of the last one sent, so
        # a client that resumes after it (starting_after) misses nothing.
        yield sse(error_event(client_error(error).body["error"], mapper.sequence))
    finally:
        if job is not None:
            if not ended and cancel_on_leave:
                await cancel_job(job, "the HTTP client disconnected")
            with anyio.CancelScope(shield=True):
                await job.aclose()


async def _replayed(
    events: list[DeltaEvent | DoneEvent | ErrorEvent],
) -> AsyncIterator[DeltaEvent | DoneEvent | ErrorEvent]:
    for event in events:
        yield event


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str,
    tenant: TenantDep,
    client: ClientDep,
    store: ResponseStoreDep,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    record, stored = await load_owned(store, response_id, tenant_of(tenant, client))
    job_id = record.job_id
    if not stream:
        state = await current_state(store, record, stored)
        return JSONResponse(response_json(record, state), headers={JOB_ID_HEADER: job_id})
    job = None
    if stored is None:  # not ended when it was loaded: follow its job
        try:
            job = await client.attach(job_id)
        except EdgeqError as error:
            raise client_error(error) from None
    return EventSourceResponse(
        _live(job, record, starting_after=starting_after, cancel_on_leave=False, stored=stored),
        headers={JOB_ID_HEADER: job_id},
        sep="\n",
    )


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str, tenant: TenantDep, client: ClientDep, store: ResponseStoreDep
) -> Response:
    record, stored = await load_owned(store, response_id, tenant_of(tenant, client))
    if stored is None:
        try:
            await client.cancel(record.job_id, f"cancelled via /v1/responses/{response_id}/cancel")
        except EdgeqError as error:
            raise client_error(error) from None
    state = await current_state(store, record, stored)
    return JSONResponse(response_json(record, state))


@router.delete("/v1/responses/{response_id}")
async def delete_response(
    response_id: str, tenant: TenantDep, client: ClientDep, store: ResponseStoreDep
) -> Response:
    record, stored = await load_owned(store, response_id, tenant_of(tenant, client))
    if stored is None:  # nobody can read it any more: stop generating it
        try:
            await client.cancel(record.job_id, "its response was deleted")
        except EdgeqError as error:
            raise client_error(error) from None
    await store.delete(record.job_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
