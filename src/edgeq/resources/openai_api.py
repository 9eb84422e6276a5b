"""OpenAI's chat-completions wire format, and its translation to and from edgeq's.

Requests are read like vLLM's server reads them: the sampling fields edgeq has, structured
output (``response_format``, vLLM's ``structured_outputs``), ``tools`` / ``tool_choice``,
``logprobs``, vLLM's ``priority``, plus ``chat_template_kwargs`` and the seed's ``extra_body``
fields (``enable_thinking``, ``return_reasoning``, which OpenAI SDKs merge into the top level of
the body). Fields an SDK sends that do not change the answer are ignored; fields that would change
it and edgeq cannot honour are refused with a 400 that names them, instead of being silently
dropped (vLLM's server ignores its legacy ``guided_json``; we say so).
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from edgeq.core.protocol import ChatResult, DoneEvent
from edgeq.core.scheduling import PRIORITIES, Priority
from edgeq.core.structured import ToolCall

#: vLLM's structured_outputs keys edgeq maps: regex, choice and grammar to ``constraint``,
#: json and json_object to ``response_format``.
STRUCTURED_OUTPUTS = ("regex", "choice", "grammar", "json", "json_object")
# A role OpenAI has that means the same as one of edgeq's.
ROLE_ALIASES = {"developer": "system"}


#: How edgeq's error messages start: the field at fault, dotted (``messages.0.role: ``).
FIELD_PREFIX = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): ")


def field_of(message: str) -> str | None:
    """The field an error message starts with (``max_tokens: ...``, ``messages.0.role: ...``),
    the way edgeq's messages name it; None if it starts with none."""
    found = FIELD_PREFIX.match(message)
    return found.group(1) if found else None


class UnsupportedField(ValueError):
    """The request asks for something edgeq does not do; the message names the field (and
    so does ``param``: given, or the field the message starts with)."""

    code = "unsupported"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param if param is not None else field_of(message)


class InvalidField(UnsupportedField):
    """A field's value is none of those it may take; the message names the field."""

    code = "invalid_request"


# --- every request body ----------------------------------------------------------------------


class RequestPart(BaseModel):
    """A part of a request body. Strict, as OpenAI is: ``"max_tokens": "10"`` or
    ``"include_usage": "yes"`` is refused, not read as 10 or true (an integer is still a
    number where a float is asked for)."""

    model_config = ConfigDict(strict=True)


def field_error(field: str, message: str, *, code: str = "invalid_request") -> PydanticCustomError:
    """A validation error naming ``field`` (the gateway's errors.py makes it the 400's
    ``param``); raised from a model validator, whose own location is the whole body."""
    return PydanticCustomError("edgeq_field", "{message}", {"field": field, "message": message,
                                                             "code": code})  # fmt: skip


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def unencodable_at(value: Any, path: str = "") -> str | None:
    """The path (``metadata.k``, ``messages.0.content``) of the first string in ``value``
    (parsed JSON), key or value, that cannot be encoded as UTF-8: one holding a lone surrogate,
    which JSON's ``\\ud800`` escape makes; None if there is none."""
    if isinstance(value, str):
        return None if _encodable(value) else path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{_escaped(str(key))}" if path else _escaped(str(key))
            if isinstance(key, str) and not _encodable(key):
                return where
            found = unencodable_at(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unencodable_at(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: A surrogate code point: in a Python string, always a lone one (a pair decodes to one
#: character).
SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings replaced by U+FFFD: how a record
    stored before its strings were checked is shown, instead of failing to render."""
    if isinstance(value, str):
        return value if _encodable(value) else SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {encodable(key): encodable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [encodable(item) for item in value]
    return value


class RequestBody(RequestPart):
    """A whole request body (chat, responses, batches, a batch line's body). Every string in
    it, extra fields' too, must be encodable: one that is not is refused here, naming it,
    before anything is stored that could not be shown again."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_strings(cls, data: Any) -> Any:
        where = unencodable_at(data)
        if where is not None:
            raise field_error(
                where,
                f"{where}: not valid text: it holds a lone surrogate (a JSON \\uD800-\\uDFFF "
                f"escape without its pair), which cannot be encoded as UTF-8",
            )
        return cls.check_raw(data)

    @classmethod
    def check_raw(cls, data: Any) -> Any:
        """A body's own checks of its raw JSON, made after its strings are known to be
        encodable (so a message may quote them); raise ``field_error``. None by default."""
        return data


#: OpenAI's ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most
#: 512, all strings (the same on every resource that takes it).
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class TextPart(RequestPart):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(RequestPart):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(RequestPart):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(RequestBody):
    # OpenAI SDKs and LangChain add fields of their own (user, metadata, store, ...).
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    return_reasoning: bool = False
    # Checked by edgeq's ChatRequest (edgeq.core.structured), whose errors name the field.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extra_body spelling
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's int (lower first, default 0) or one of edgeq's class names; see _priority.
    priority: Any = None
    metadata: Metadata | None = None  # OpenAI's (stored completions): checked, not kept

    def unsupported(self) -> str | None:
        """The first field asking for what edgeq cannot do, described; None if all is fine."""
        extra = self.model_extra or {}
        if self.n not in (None, 1):
            return "n: edgeq returns one choice per request; send n=1 or leave it out"
        for name in ("functions", "function_call"):
            if extra.get(name) is not None:
                return f"{name}: OpenAI's legacy functions API is not supported; send tools"
        for name in sorted(extra):
            if name.startswith("guided_"):
                return (
                    f"{name}: vLLM's legacy guided decoding fields are not supported; send "
                    f"response_format or structured_outputs"
                )
        unknown = set(self.structured_outputs or {}) - set(STRUCTURED_OUTPUTS)
        if unknown:
            return (
                f"structured_outputs.{sorted(unknown)[0]}: not supported by edgeq "
                f"(one of {', '.join(STRUCTURED_OUTPUTS)})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if extra.get(name) not in (None, 0, 0.0):
                return f"{name}: not supported by edgeq; leave it out or send 0"
        if extra.get("logit_bias"):
            return "logit_bias: not supported by edgeq"
        return None

    def edgeq_fields(self) -> dict[str, Any]:
        """The request as edgeq's ChatRequest fields (validated by the client's submit)."""
        unsupported = self.unsupported()
        if unsupported:
            raise UnsupportedField(unsupported)
        messages = [_edgeq_message(index, message) for index, message in enumerate(self.messages)]
        fields: dict[str, Any] = {"messages": messages, "return_reasoning": self.return_reasoning}
        max_tokens = self.max_completion_tokens or self.max_tokens
        response_format, constraint = self._structured()
        for name, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("max_tokens", max_tokens),
            ("stop", self.stop),
            ("seed", self.seed),
            ("enable_thinking", self._thinking()),
            ("response_format", response_format),
            ("constraint", constraint),
            ("tools", self.tools),
            ("tool_choice", self.tool_choice),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("logprobs", self.logprobs),
            ("top_logprobs", self.top_logprobs),
            ("priority", self._priority()),
        ):
            if value is not None:
                fields[name] = value
        return fields

    def _structured(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(response_format, constraint): vLLM's structured_outputs in edgeq's fields."""
        given = dict(self.structured_outputs or {})
        response_format = self.response_format
        if "json" in given:
            schema = given.pop("json")
            response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
        elif given.pop("json_object", None):
            response_format = {"type": "json_object"}
        return response_format, given or None

    def _priority(self) -> Priority | None:
        """edgeq's class for ``priority``: vLLM's int read in vLLM's direction (below 0 goes
        first: interactive; 0: default; above 0: batch), or a class name as it is."""
        value = self.priority
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return PRIORITIES[0] if value < 0 else PRIORITIES[2] if value > 0 else PRIORITIES[1]
        if isinstance(value, str) and value in PRIORITIES:
            return value  # type: ignore[return-value]  # one of the Literal's values
        shown = json.dumps(value, ensure_ascii=False)  # as the client sent it: true, 1.5
        shown = shown if len(shown) <= 40 else f"{shown[:37]}..."
        raise InvalidField(
            f"priority: must be an integer as vLLM takes it (below 0: interactive, 0: default, "
            f"above 0: batch) or one of {', '.join(repr(name) for name in PRIORITIES)} "
            f"(got {shown})",
            param="priority",
        )

    def _thinking(self) -> bool | None:
        if self.enable_thinking is not None:
            return self.enable_thinking
        kwargs = self.chat_template_kwargs or {}
        value = kwargs.get("enable_thinking")
        return value if isinstance(value, bool) else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _edgeq_message(index: int, message: Message) -> dict[str, Any]:
    role = ROLE_ALIASES.get(message.role, message.role)
    if role not in ("system", "user", "assistant", "tool"):
        raise UnsupportedField(
            f"messages.{index}.role: {message.role!r} is not supported by edgeq "
            f"(system, developer, user, assistant or tool)"
        )
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        for part_index, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise UnsupportedField(
                    f"messages.{index}.content.{part_index}: {part.type} is not supported by "
                    f"edgeq (text parts only)",
                    param=f"messages.{index}.content.{part_index}",
                )
        text = "".join(part.text or "" for part in content)
    fields: dict[str, Any] = {"role": role, "content": text}
    if message.tool_calls:
        fields["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


# --- responses -------------------------------------------------------------------------------


def completion_id(job_id: str) -> str:
    return f"chatcmpl-{job_id}"


def usage_json(done: DoneEvent | ChatResult) -> dict[str, int]:
    usage = done.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def tool_calls_json(calls: list[ToolCall], *, streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls``; a streamed one numbers each call (all arrive in one chunk)."""
    items = [call.model_dump(mode="json") for call in calls]
    if streamed:
        items = [{"index": index, **item} for index, item in enumerate(items)]
    return items


def logprobs_json(done: DoneEvent | ChatResult) -> dict[str, Any] | None:
    if done.logprobs is None:
        return None
    return {"content": [item.model_dump(mode="json") for item in done.logprobs], "refusal": None}


def completion_json(result: ChatResult, *, model: str, created: int) -> dict[str, Any]:
    """The non-streaming answer."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = tool_calls_json(result.tool_calls)
        message["content"] = result.text or None  # OpenAI: null when the answer is only calls
    return {
        "id": completion_id(result.job_id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs_json(result),
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": usage_json(result),
    }


def chunk_json(
    job_id: str,
    *,
    model: str,
    created: int,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; with ``usage`` it is the usage-only chunk (no choices)."""
    chunk: dict[str, Any] = {
        "id": completion_id(job_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if usage is not None:
        chunk["usage"] = usage
    else:
        chunk["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    return chunk


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
    "rate_limit_error", "server_error", "service_unavailable",
]  # fmt: skip


def error_json(
    message: str, *, type: ErrorType, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body, which its SDKs turn into their exception types. A message or
    param quoting a lone surrogate of the request is shown with U+FFFD: an error that cannot
    be rendered would be a 500."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return {"error": encodable(error)}


def now_s() -> int:
    return int(time.time())


def list_json(data: list[Any], has_more: bool = False) -> dict[str, Any]:
    """A page of a list resource (files, batches), with the cursors OpenAI's SDKs page by."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
