"""The wire contract between producers and workers.

Everything a service in any language needs is here: the job payload (``ChatRequest``), the
stream events published on each job's channel (names in ``edgeq.core.keys``), and the
serializer both sides give arq.
README's "Wire contract" section describes the same thing in words; keep them together.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

#: The arq function name every chat job is enqueued under.
JOB_FUNCTION = "chat"


class ErrorCode(StrEnum):
    """Stable short words for why a job ended without an answer."""

    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    EXPIRED = "expired"
    WORKER_LOST = "worker_lost"
    ENGINE_ERROR = "engine_error"


# --- the request -----------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    """One chat job. Sampling fields left out take the box-wide defaults of the worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[Annotated[str, Field(min_length=1)]] | None = None
    seed: int | None = Field(None, ge=0)
    enable_thinking: bool | None = None
    return_reasoning: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _single_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def limit_problem(
    request: ChatRequest, size_bytes: int, *, max_bytes: int, max_messages: int, max_tokens: int
) -> str | None:
    """Why a request exceeds the box's size limits, or None. Checked by the producer and
    again by the worker (a producer in another language may not check)."""
    if size_bytes > max_bytes:
        return (
            f"request: {size_bytes} bytes, more than the {max_bytes} allowed "
            f"(EDGEQ_MAX_REQUEST_BYTES)"
        )
    if len(request.messages) > max_messages:
        return (
            f"messages: {len(request.messages)} messages, more than the {max_messages} "
            f"allowed (EDGEQ_MAX_MESSAGES)"
        )
    if request.max_tokens is not None and request.max_tokens > max_tokens:
        return (
            f"max_tokens: {request.max_tokens}, more than the {max_tokens} allowed "
            f"(EDGEQ_MAX_TOKENS_LIMIT)"
        )
    return None


def describe_validation_error(error: ValidationError) -> str:
    """Pydantic's error as one sentence per problem, each naming the field at fault."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "request"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


# --- the stream ------------------------------------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    seq: int = Field(ge=0)


class DeltaEvent(_Event):
    type: Literal["delta"] = "delta"
    text: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    """Milliseconds, all measured from the moment the job was enqueued."""

    queued_ms: float
    ttft_ms: float | None
    total_ms: float


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    finish_reason: str
    usage: Usage
    timings: Timings
    reasoning: str | None = None


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str
    message: str


StreamEvent = Annotated[DeltaEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]
_stream_event = TypeAdapter(StreamEvent)


def encode_event(event: DeltaEvent | DoneEvent | ErrorEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode()


def decode_event(raw: bytes | str) -> DeltaEvent | DoneEvent | ErrorEvent:
    return _stream_event.validate_json(raw)


class ChatResult(BaseModel):
    """The whole answer: what ``ChatJob.result()`` returns and the arq job result holds."""

    job_id: str
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    reasoning: str | None = None


# --- arq serialization -----------------------------------------------------------------------


def json_default(value: Any) -> Any:
    # arq stores failures (CancelledError, TimeoutError) as the result; JSON has no exception
    # type, so keep what a reader needs: which exception and what it said.
    if isinstance(value, BaseException):
        return {"exception": type(value).__name__, "message": str(value)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dump_json(value: Any) -> bytes:
    """arq's job_serializer on both sides: JSON, never pickle."""
    return json.dumps(value, default=json_default, separators=(",", ":")).encode()


def load_json(raw: bytes) -> Any:
    return json.loads(raw)
