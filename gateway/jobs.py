"""A job seen from the gateway: waiting on it while its HTTP client may leave, cancelling it
when nobody will read the answer, and how long it took (for the log).

A client that goes away cancels its job, so the engine stops generating for it; so does a
gateway that shuts down before the answer is complete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import anyio
import structlog
from fastapi import Request

from edgeq.core.errors import EdgeqError
from edgeq.core.tasks import cancel_and_wait
from edgeq.gateway.errors import ApiError, client_error
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.resources.model_names import ModelNames
from edgeq.resources.openai_api import ChatCompletionRequest, UnsupportedField
from edgeq.resources.submit import ModelNotServed, submit

#: The status nginx logs when the client went away; nobody receives it.
CLIENT_CLOSED_REQUEST = 499
#: Every answer names its job, so a caller can watch or cancel it with edgeq's own tools.
JOB_ID_HEADER = "X-Edgeq-Job-Id"
SHUTDOWN_REASON = (
    "the gateway shut down before the answer was complete (EDGEQ_GATEWAY_SHUTDOWN_TIMEOUT_S)"
)

log = structlog.get_logger("edgeq.gateway")
T = TypeVar("T")


async def submit_job(
    client: ChatClient,
    models: ModelNames,
    body: ChatCompletionRequest,
    tenant: str | None,
    retry_after_s: int,
    *,
    idempotency_key: str | None = None,
    key_name: str | None = None,
) -> tuple[ChatJob, dict[str, Any]]:
    """The body's job (resources/submit.py), or the ApiError its refusal is answered with: a
    model not served here (404), a field edgeq cannot honour (400), what ChatClient refuses
    (a full queue: 429 with Retry-After; an idempotency key given to another request: 409)."""
    try:
        return await submit(
            client, models, body, tenant, idempotency_key=idempotency_key, key_name=key_name
        )
    except ModelNotServed as error:
        raise ApiError(
            404, str(error), type="not_found_error", code="model_not_found", param="model"
        ) from None
    except UnsupportedField as error:
        raise ApiError(
            400, str(error), type="invalid_request_error", code=error.code, param=error.param
        ) from None
    except EdgeqError as error:
        raise client_error(error, retry_after_s=retry_after_s) from None


class CancellableJob(Protocol):
    """What the gateway needs of a job to stop it (ChatJob is one)."""

    job_id: str

    async def cancel(self, reason: str = ...) -> bool: ...

    async def aclose(self) -> None: ...


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


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


async def cancel_job(job: CancellableJob, reason: str) -> None:
    """Cancel the job even while this task is itself being cancelled (a closed connection)."""
    with anyio.CancelScope(shield=True):
        try:
            await job.cancel(reason)
        except EdgeqError as error:
            log.warning("gateway_cancel_failed", error=str(error))


def ms_since(started: float) -> float:
    """Milliseconds since ``started`` (a time.monotonic() reading), as the log shows them."""
    return round((time.monotonic() - started) * 1000, 3)
