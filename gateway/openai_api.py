"""OpenAI's chat-completions wire format, and its translation to and from edgeq's.

Requests are read like vLLM's server reads them: the sampling fields edgeq has, plus
``chat_template_kwargs`` and the seed's ``extra_body`` fields (``enable_thinking``,
``return_reasoning``, which OpenAI SDKs merge into the top level of the body). Fields an SDK
sends that do not change the answer are ignored; fields that would change it and edgeq cannot
honour are refused with a 400 that names them, instead of being silently dropped.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeq.core.protocol import ChatResult, DoneEvent

# A role OpenAI has that means the same as one of edgeq's.
ROLE_ALIASES = {"developer": "system"}


class UnsupportedField(ValueError):
    """The request asks for something edgeq does not do; the message names the field."""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
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

    def unsupported(self) -> str | None:
        """The first field asking for what edgeq cannot do, described; None if all is fine."""
        extra = self.model_extra or {}
        if self.n not in (None, 1):
            return "n: edgeq returns one choice per request; send n=1 or leave it out"
        for name in ("tools", "functions"):
            if extra.get(name):
                return f"{name}: tool calling is not supported by edgeq"
        if extra.get("tool_choice") not in (None, "none"):
            return "tool_choice: tool calling is not supported by edgeq"
        response_format = extra.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
            return "response_format: only text answers are supported by edgeq"
        if extra.get("logprobs"):
            return "logprobs: not supported by edgeq"
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
        for name, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("max_tokens", max_tokens),
            ("stop", self.stop),
            ("seed", self.seed),
            ("enable_thinking", self._thinking()),
        ):
            if value is not None:
                fields[name] = value
        return fields

    def _thinking(self) -> bool | None:
        if self.enable_thinking is not None:
            return self.enable_thinking
        kwargs = self.chat_template_kwargs or {}
        value = kwargs.get("enable_thinking")
        return value if isinstance(value, bool) else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _edgeq_message(index: int, message: Message) -> dict[str, str]:
    role = ROLE_ALIASES.get(message.role, message.role)
    if role not in ("system", "user", "assistant"):
        raise UnsupportedField(
            f"messages.{index}.role: {message.role!r} is not supported by edgeq "
            f"(system, developer, user or assistant)"
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
                    f"messages.{index}.content.{part_index}: only text parts are supported "
                    f"by edgeq (got type {part.type!r})"
                )
        text = "".join(part.text or "" for part in content)
    return {"role": role, "content": text}


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


def completion_json(result: ChatResult, *, model: str, created: int) -> dict[str, Any]:
    """The non-streaming answer."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    return {
        "id": completion_id(result.job_id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
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
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        ]
    return chunk


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
    "server_error", "service_unavailable",
]  # fmt: skip


def error_json(
    message: str, *, type: ErrorType, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body, which its SDKs turn into their exception types."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def now_s() -> int:
    return int(time.time())
