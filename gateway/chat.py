"""``/v1/chat/completions``: each chat completion becomes one edgeq job.

    HTTP client -> gateway -> ChatClient.submit -> Redis queue -> worker -> engine
                       <- SSE chunks <- the job's pub/sub channel <-

A request waits for its job's first event before answering, so a job the worker refuses (a
prompt too long, a queue deadline passed) still gets a proper HTTP status even when streaming.
A client that goes away cancels its job: the engine stops generating for it (one that sent an
``Idempotency-Key`` too: a retry of it after the cancel gets the cancelled job). The job's tenant
is the request's (auth.py); its priority class is the body's ``priority``
(edgeq.resources.openai_api).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from edgeq.core.errors import EdgeqError, JobFailed
from edgeq.core.protocol import ChatResult, ErrorEvent, StreamEvent
from edgeq.core.scheduling import DEFAULT_PRIORITY
from edgeq.gateway.auth import KeyNameDep, TenantDep
from edgeq.gateway.errors import ApiError, client_error
from edgeq.gateway.jobs import (
    CLIENT_CLOSED_REQUEST,
    JOB_ID_HEADER,
    SHUTDOWN_REASON,
    ClientGone,
    cancel_job,
    ms_since,
    submit_job,
    until_disconnected,
)
from edgeq.gateway.sse import stream_response
from edgeq.gateway.state import ClientDep, ModelNamesDep, SettingsDep
from edgeq.producer.client import ChatJob
from edgeq.producer.queue import IDEMPOTENCY_KEY_PATTERN
from edgeq.resources.openai_api import (
    ChatCompletionRequest,
    completion_json,
    now_s,
)

log = structlog.get_logger("edgeq.gateway")
router = APIRouter()

#: A request sent again with the same value (per tenant, within EDGEQ_IDEMPOTENCY_TTL_S) gets
#: the first one's job, from the start of its answer, instead of a second job (Stripe's name;
#: the OpenAI SDKs send it with ``extra_headers``).
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"


def idempotency_key(request: Request) -> str | None:
    """The request's Idempotency-Key, if it sent one; a malformed one is a 400 naming it."""
    key = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if key is not None and not re.fullmatch(IDEMPOTENCY_KEY_PATTERN, key):
        raise ApiError(
            400,
            f"{IDEMPOTENCY_KEY_HEADER}: 1 to 255 visible ASCII characters, no spaces",
            type="invalid_request_error",
            code="invalid_request",
            param=IDEMPOTENCY_KEY_HEADER,
        )
    return key


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request,
    body: ChatCompletionRequest,
    tenant: TenantDep,
    key_name: KeyNameDep,
    client: ClientDep,
    models: ModelNamesDep,
    settings: SettingsDep,
    key: Annotated[str | None, Depends(idempotency_key)],
) -> Response:
    started = time.monotonic()
    retry_after_s = settings.gateway_retry_after_s
    job, fields = await submit_job(
        client, models, body, tenant, retry_after_s, idempotency_key=key, key_name=key_name
    )
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
            job, first, events, model=body.model, include_usage=body.include_usage,
            started=started, log=bound, headers=headers,
            shutdown_timeout_s=settings.gateway_shutdown_timeout_s,
        )  # fmt: skip
    bound.info("gateway_done", total_ms=ms_since(started))
    return JSONResponse(completion_json(result, model=body.model, created=now_s()), headers=headers)


async def _rest_of_answer(job: ChatJob, events: AsyncIterator[StreamEvent]) -> ChatResult:
    async for _ in events:  # the job collects the text as its stream is read
        pass
    return await job.result()
