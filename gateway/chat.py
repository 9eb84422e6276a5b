"""``/v1/chat/completions``: each chat completion becomes one edgeq job.

    HTTP client -> gateway -> ChatClient.submit -> Redis queue -> worker -> engine
                       <- SSE chunks <- the job's pub/sub channel <-

A request waits for its job's first event before answering, so a job the worker refuses (a
prompt too long, a queue deadline passed) still gets a proper HTTP status even when streaming.
A client that goes away cancels its job: the engine stops generating for it. The job's tenant
is the request's (auth.py); its priority class is the body's ``priority`` (openai_api.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edgeq.core.errors import EdgeqError, JobFailed
from edgeq.core.protocol import ChatResult, ErrorEvent, StreamEvent
from edgeq.core.scheduling import DEFAULT_PRIORITY
from edgeq.gateway.auth import TenantDep
from edgeq.gateway.errors import ApiError, client_error
from edgeq.gateway.jobs import (
    CLIENT_CLOSED_REQUEST,
    JOB_ID_HEADER,
    SHUTDOWN_REASON,
    ClientGone,
    cancel_job,
    ms_since,
    until_disconnected,
)
from edgeq.gateway.models import ModelNames, ModelNamesDep
from edgeq.gateway.openai_api import (
    ChatCompletionRequest,
    UnsupportedField,
    completion_json,
    now_s,
)
from edgeq.gateway.sse import stream_response
from edgeq.gateway.state import ClientDep, SettingsDep
from edgeq.producer.client import ChatClient, ChatJob

log = structlog.get_logger("edgeq.gateway")
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request,
    body: ChatCompletionRequest,
    tenant: TenantDep,
    client: ClientDep,
    models: ModelNamesDep,
    settings: SettingsDep,
) -> Response:
    started = time.monotonic()
    job, fields = await submit(client, models, body, tenant, settings.gateway_retry_after_s)
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
        await cancel_job(job, "the HTTP client disconnected")
        bound.info("gateway_client_gone", waited_ms=ms_since(started))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except JobFailed as error:
        await job.aclose()  # the stream has ended; stop listening now, not at GC
        failure = client_error(error)
        failure.headers = headers
        bound.info("gateway_job_failed", status=failure.status, code=error.code)
        raise failure from None
    except EdgeqError as error:
        await cancel_job(job, f"the gateway lost the job's stream: {error}")
        raise client_error(error) from None
    except asyncio.CancelledError:  # the server stopped waiting (shutdown timeout)
        await cancel_job(job, SHUTDOWN_REASON)
        raise
    except Exception as error:  # a bug of ours: the client gets a 500, the job must end
        await cancel_job(job, f"the gateway failed: {type(error).__name__}")
        raise
    if body.stream:
        return stream_response(
            job,
            first,
            events,
            model=body.model,
            include_usage=body.include_usage,
            started=started,
            log=bound,
            headers=headers,
            shutdown_timeout_s=settings.gateway_shutdown_timeout_s,
        )
    bound.info("gateway_done", total_ms=ms_since(started))
    return JSONResponse(completion_json(result, model=body.model, created=now_s()), headers=headers)


async def submit(
    client: ChatClient,
    models: ModelNames,
    body: ChatCompletionRequest,
    tenant: str | None,
    retry_after_s: int,
) -> tuple[ChatJob, dict[str, Any]]:
    """Enqueue the body's job for ``tenant``: the job, and the edgeq fields it was sent with
    (less its messages). A model not served here, a field edgeq cannot honour, or what
    ChatClient refuses (a full queue: 429 with Retry-After) is raised as its ApiError."""
    try:
        names = await models.names()
        if body.model not in names:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist here; this gateway serves "
                f"{', '.join(names)} (EDGEQ_MODEL, EDGEQ_GATEWAY_MODEL_ALIASES, adapters)",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )
        fields = body.edgeq_fields()
        if tenant is not None:
            fields["tenant"] = tenant
        if body.model in await models.adapters():  # as vLLM's server: an adapter is a model
            fields["adapter"] = body.model
        job = await client.submit(fields.pop("messages"), **fields)
    except UnsupportedField as error:
        raise ApiError(
            400, str(error), type="invalid_request_error", code=error.code, param=error.param
        ) from None
    except EdgeqError as error:
        raise client_error(error, retry_after_s=retry_after_s) from None
    return job, fields


async def _rest_of_answer(job: ChatJob, events: AsyncIterator[StreamEvent]) -> ChatResult:
    async for _ in events:  # the job collects the text as its stream is read
        pass
    return await job.result()
