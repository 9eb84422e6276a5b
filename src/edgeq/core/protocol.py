"""The wire contract between producers and workers.

Everything a service in any language needs is here: the job payload (``ChatRequest``), the
stream events published on each job's channel (names in ``edgeq.core.keys``), and the
serializer both sides give arq.
README's "Wire contract" section describes the same thing in words; keep them together.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from edgeq.core.adapters import ADAPTER_PATTERN
from edgeq.core.scheduling import TENANT_PATTERN, Priority
from edgeq.core.structured import (
    MAX_TOP_LOGPROBS,
    Constraint,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
)

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
    POISON_JOB = "poison_job"


# --- the request -----------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """One turn. An assistant turn may carry the tool calls it made (its content may then be
    empty); a ``tool`` turn carries one call's result."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only a tool message has one, not {self.role}")
        return self


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
    # Structured answers and tools: see edgeq.core.structured.
    response_format: ResponseFormat | None = None
    constraint: Constraint | None = None
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # When the worker running the job dies: another worker continues the stream ("continue",
    # the default when left out) or it ends with worker_lost ("fail").
    on_worker_lost: Literal["continue", "fail"] | None = None
    # Who goes first (edgeq.core.scheduling): the class, and whose share the job counts to.
    # None: "default", and the client's EDGEQ_TENANT.
    priority: Priority | None = None
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)
    # The name of the API key the request came with (never the key itself): its own rate
    # limits (core/limits.py) and usage-ledger rows (core/ledger.py), within its tenant's.
    key_name: str | None = Field(None, pattern=TENANT_PATTERN)
    # The LoRA adapter to answer with (core/adapters.py); None: the tenant's default adapter
    # on the worker (EDGEQ_TENANT_ADAPTERS), else the base model.
    adapter: str | None = Field(None, pattern=ADAPTER_PATTERN)
    # False: the answer is published as one delta when it ends, just before its done event,
    # instead of as it is made; for callers that only want the result (a batch's lines). None:
    # streamed. See docs/wire-contract.md.
    stream: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _single_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique (got {', '.join(names)})")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError(f"tool_choice: {self._choice_name()} needs tools to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice: names {choice.function.name!r}, which is not in tools "
                f"({', '.join(names)})"
            )
        constraints = [
            name
            for name, given in (
                ("response_format", self.json_format is not None),
                ("constraint", self.constraint is not None),
                (f"tool_choice={self._choice_name()}", self.forces_tool_call),
            )
            if given
        ]
        if len(constraints) > 1:
            raise ValueError(f"{' and '.join(constraints)}: only one can shape an answer")
        if constraints and self.enable_thinking:
            raise ValueError(
                f"enable_thinking: a constrained answer ({constraints[0]}) is generated "
                f"without thinking; leave enable_thinking out or send false"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    @property
    def json_format(self) -> JsonObjectFormat | JsonSchemaFormat | None:
        """The JSON response format asked for, if any ("text" is no format)."""
        if isinstance(self.response_format, JsonObjectFormat | JsonSchemaFormat):
            return self.response_format
        return None

    @property
    def forces_tool_call(self) -> bool:
        """``tool_choice`` is "required" or names a function: the answer is only calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def constrained(self) -> bool:
        """The sampler is held to a grammar (JSON, regex, choice, grammar or forced calls)."""
        return (
            self.json_format is not None or self.constraint is not None or (self.forces_tool_call)
        )

    @property
    def tools_offered(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def _choice_name(self) -> str:
        choice = self.tool_choice
        return (
            f"function {choice.function.name}"
            if isinstance(choice, NamedToolChoice)
            else (str(choice))
        )


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


class SizeLimits(Protocol):
    """The box's request size limits, as the settings name them (core/settings.py)."""

    max_request_bytes: int
    max_messages: int
    max_tokens_limit: int


def job_payload(request: ChatRequest, limits: SizeLimits) -> tuple[dict[str, Any], str | None]:
    """The request as a job's payload, and why it exceeds ``limits`` (None: it does not).
    A producer's check before it enqueues: the client's, and a batch line's."""
    payload = request.model_dump(mode="json", exclude_none=True)
    problem = limit_problem(
        request,
        len(dump_json(payload)),
        max_bytes=limits.max_request_bytes,
        max_messages=limits.max_messages,
        max_tokens=limits.max_tokens_limit,
    )
    return payload, problem


def describe_validation_error(error: ValidationError) -> str:
    """Pydantic's error as one sentence per problem, each naming the field at fault."""
    parts = []
    for item in error.errors():
        message = item["msg"]
        if item["type"] == "value_error":  # our own validators' messages name the field
            message = message.removeprefix("Value error, ")
            if not item["loc"]:
                parts.append(message)
                continue
        where = ".".join(str(part) for part in item["loc"]) or "request"
        parts.append(f"{where}: {message}")
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
    #: None when this start of the job produced no token (a continued job whose dead worker
    #: had streamed the whole answer). Events leave out None fields, so it needs its default.
    ttft_ms: float | None = None
    total_ms: float


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    finish_reason: str
    usage: Usage
    timings: Timings
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprob] | None = None
    #: How many times another worker took the job over after its worker died.
    continued: int | None = None


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
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprob] | None = None
    continued: int | None = None

    @classmethod
    def from_done(cls, done: DoneEvent, text: str) -> ChatResult:
        """The result of a stream whose deltas added up to ``text`` and that ended ``done``."""
        fields = {name: getattr(done, name) for name in cls.model_fields if name != "text"}
        return cls(text=text, **fields)


# --- arq serialization -----------------------------------------------------------------------


def json_default(value: Any) -> Any:
    # arq stores failures (CancelledError, TimeoutError) as the result; JSON has no exception
    # type, so keep what a reader needs: which exception and what it said.
    if isinstance(value, BaseException):
        return {"exception": type(value).__name__, "message": str(value)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def record_request(payload: bytes | str | None) -> dict[str, Any] | None:
    """The chat request inside an arq job record as edgeq's producers write it (JSON: the
    job's one argument, ``a[0]``); None if the record is missing or not such a record."""
    try:
        record = json.loads(payload or b"")
        request = record["a"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return request if isinstance(request, dict) else None


def dump_json(value: Any) -> bytes:
    """arq's job_serializer on both sides: JSON, never pickle."""
    return json.dumps(value, default=json_default, separators=(",", ":")).encode()


def load_json(raw: bytes) -> Any:
    return json.loads(raw)
