"""Every error the gateway answers with, in OpenAI's shape (``{"error": {...}}``).

OpenAI SDKs turn the status and body into their exception types (and retry 429 and 5xx on
their own), so what a failed job, a ChatClient error, a bad body or an unknown path becomes is
decided here, in one place: ``job_error`` and ``client_error`` map edgeq's errors, and
``install_error_handlers`` makes FastAPI's own errors look the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeq.core.errors import (
    EdgeqError,
    IdempotencyConflict,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    PoisonRefused,
    QueueFull,
    RateLimited,
    RedisUnavailable,
)
from edgeq.core.protocol import ErrorCode
from edgeq.resources.batches.store import BatchApiError
from edgeq.resources.openai_api import ErrorType, error_json, field_of

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
    # Not a 5xx: the SDK would send the request that took down two engines once more.
    ErrorCode.POISON_JOB: 422,
}


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


def job_error(code: str, message: str) -> ApiError:
    """A job's ``error`` event (its stable code and sentence) as an HTTP error."""
    status = JOB_ERROR_STATUS.get(code, 500)
    kind: ErrorType = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code)


def client_error(error: EdgeqError, *, retry_after_s: int | None = None) -> ApiError:
    """What ChatClient raised, as the HTTP error a caller of OpenAI expects."""
    if isinstance(error, PoisonRefused):
        # 422 like the poison_job it repeats (JOB_ERROR_STATUS): an SDK does not retry it, and
        # waiting a few seconds would not help (Retry-After says when the refusal ends).
        return ApiError(
            422,
            str(error),
            type="invalid_request_error",
            code="poison_refused",
            headers={"Retry-After": str(error.retry_after_s)},
        )
    if isinstance(error, InvalidRequest):  # its message starts with the field at fault
        return ApiError(
            400,
            str(error),
            type="invalid_request_error",
            code="invalid_request",
            param=field_of(str(error)),
        )
    if isinstance(error, IdempotencyConflict):
        return ApiError(
            409,
            str(error),
            type="invalid_request_error",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )
    if isinstance(error, RateLimited):
        return rate_limited(error)
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


def rate_limited(error: RateLimited) -> ApiError:
    """A tenant over its rate limit or token budget (docs/limits.md): 429 with Retry-After
    (until the refusing limit's window turns) and OpenAI's x-ratelimit-* headers for the
    minute's limits that are set (tokens: prompt, estimated, plus max_tokens)."""
    refusal = error.refusal
    headers = {"Retry-After": str(error.retry_after_s)}
    reset = f"{refusal.minute_reset_s:g}s"
    for kind, limit, remaining in (
        ("requests", refusal.requests_limit, refusal.requests_remaining),
        ("tokens", refusal.tokens_limit, refusal.tokens_remaining),
    ):
        if limit > 0:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return ApiError(
        429,
        str(error),
        type="rate_limit_error",
        # OpenAI's codes: a minute's limit, or a quota (here the day's or month's budget).
        code="rate_limit_exceeded" if refusal.limit in ("requests", "tokens")
        else "insufficient_quota",
        headers=headers,
    )


@contextmanager
def batch_api_errors() -> Iterator[None]:
    """What the Files/Batches API refuses (and Redis being away) as OpenAI's errors."""
    try:
        yield
    except BatchApiError as error:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            error.status, "invalid_request_error"
        )
        raise ApiError(
            error.status,
            str(error),
            type=kind,
            code=error.code,  # type: ignore[arg-type]
            param=error.param,
        ) from None
    except EdgeqError as error:
        raise client_error(error) from None


async def api_error(_: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 for a body that does not parse, as the 400 OpenAI sends, naming the
    first bad field as ``param`` and every problem in the message."""
    problems = [_problem(item) for item in error.errors()]
    param, code = problems[0][1:] if problems else (None, "invalid_request")
    message = "; ".join(text for text, _, _ in problems) or "body: invalid"
    return ApiError(400, message, type="invalid_request_error", code=code, param=param).response()


def _problem(item: dict[str, Any]) -> tuple[str, str | None, str]:
    """One of pydantic's errors as (the sentence, the field it names, the error code)."""
    ctx = item.get("ctx") or {}
    if item["type"] == "edgeq_field":  # openai_api.field_error: it names its own field
        return ctx["message"], ctx["field"], ctx.get("code", "invalid_request")
    if item["type"] == "json_invalid":  # loc holds a character position, not a field
        return (
            f"body: not valid JSON ({ctx.get('error', 'JSON decode error')} at character "
            f"{item['loc'][-1]})",
            None,
            "invalid_json",
        )
    # loc starts with where the value came from ("body"); the rest is the field's path.
    where = ".".join(str(part) for part in item["loc"][1:])
    return f"{where or 'body'}: {item['msg']}", where or None, "invalid_request"


async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape too."""
    kind: ErrorType = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return ApiError(error.status_code, str(error.detail), type=kind).response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` answers with one in OpenAI's shape."""
    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_body)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
