"""A request's structured-output fields as vLLM parameters, and generated text back as tool
calls and logprobs.

How each kind of answer is produced (README, "Structured output and tools"):

- JSON formats, ``constraint``: the sampler is held to the grammar (xgrammar, compiled once
  per distinct schema and cached by vLLM), so a finished answer parses (JSON's strings get
  the control characters xgrammar lets in escaped as they stream: ``JsonStringEscaper``).
- ``tool_choice`` "required" or a named function: as vLLM's own server does, the answer is
  constrained to JSON — a list of ``{"name", "parameters"}`` objects, or the named
  function's arguments — and parsed into calls. Nothing streams as text.
- ``tool_choice`` "auto" (the default when tools are given): the model writes freely; text
  streams until a ``<tool_call>`` block begins, and the blocks are parsed by vLLM's Hermes
  parser (the format Qwen3's template teaches) when the answer ends.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from edgeq.core.protocol import ChatRequest
from edgeq.core.structured import (
    FunctionCall,
    JsonObjectFormat,
    NamedToolChoice,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)

TOOL_CALL_OPEN = Hermes2ProToolParser.tool_call_start_token
# JSON's short escapes for control characters; the others are written \u00XX.
JSON_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
# JSON has no -inf; OpenAI's and vLLM's servers send this floor instead.
LOGPROB_FLOOR = -9999.0


def constraint_field(request: ChatRequest) -> str:
    """The request field that shaped the answer, for error messages."""
    if request.forces_tool_call:
        return "tools"
    return "response_format" if request.json_format is not None else "constraint"


# xgrammar's errors start with a clock time and a C++ source location: "[11:55:54]
# /project/cpp/regex_converter.cc:83: Regex parsing error ...".
_CPP_LOCATION = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+\.cc:\d+: ")


def grammar_problem(error: Exception) -> str:
    """vLLM's message for a grammar it could not compile, with xgrammar's reason when vLLM
    chained it (the grammar case), without xgrammar's source locations."""
    message = str(error)
    if error.__cause__ is not None:
        message = f"{message.rstrip('.')}: {error.__cause__}"
    return " ".join(_CPP_LOCATION.sub("", message).split())


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema is not None else {"type": "object", "properties": {}}


def forced_calls_schema(request: ChatRequest) -> dict[str, Any]:
    """The JSON Schema an answer of forced calls must follow."""
    tools = {tool.function.name: tool.function for tool in request.tools or ()}
    if isinstance(request.tool_choice, NamedToolChoice):
        return _parameters(tools[request.tool_choice.function.name].parameters)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": _parameters(function.parameters),
                    },
                    "required": ["name", "parameters"],
                }
                for name, function in tools.items()
            ]
        },
    }
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def structured_outputs(request: ChatRequest) -> StructuredOutputsParams | None:
    """vLLM's structured-output parameters for the request, or None for free text."""
    if request.forces_tool_call:
        return StructuredOutputsParams(json=forced_calls_schema(request))
    json_format = request.json_format
    if isinstance(json_format, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    if json_format is not None:
        return StructuredOutputsParams(json=json_format.json_schema.json_schema)
    constraint = request.constraint
    if constraint is not None:
        return StructuredOutputsParams(
            regex=constraint.regex, choice=constraint.choice, grammar=constraint.grammar
        )
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


class _ForcedCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    parameters: dict[str, Any]


_forced_calls = TypeAdapter(list[_ForcedCall])


class AnswerReader:
    """Feed it the answer text as it streams: it returns what may stream now (JSON with its
    strings' control characters escaped, text up to a tool call) and keeps tool-call text
    back; ``finish`` parses the calls when the answer is complete."""

    def __init__(self, request: ChatRequest, tokenizer: Any) -> None:
        self._request = request
        self._tokenizer = tokenizer
        # Read once: feed runs for every engine output (a token each, by default).
        self._forced = request.forces_tool_call
        self._auto = request.tools_offered and not self._forced
        self._text: list[str] = []  # kept only where finish parses it
        self._sent = 0  # characters of the answer streamed as content
        json_answer = request.json_format is not None or self._forced
        self._escaper = JsonStringEscaper() if json_answer else None

    def feed(self, text: str) -> str:
        if self._escaper is not None:
            text = self._escaper.feed(text)
        if not (self._auto or self._forced):
            return text
        self._text.append(text)
        if self._forced:
            return ""
        answer = "".join(self._text)
        start = answer.find(TOOL_CALL_OPEN)
        if start < 0:  # keep back a tail that could be the start of the tag
            start = len(answer) - _partial_tag(answer, TOOL_CALL_OPEN)
        sendable, self._sent = answer[self._sent : start], max(self._sent, start)
        return sendable

    def finish(self) -> tuple[str, list[ToolCall] | None]:
        """(content still to stream, the calls or None)."""
        answer = "".join(self._text)
        if self._forced:
            return "", self._parse_forced(answer)
        if not self._auto:
            return "", None
        extracted = Hermes2ProToolParser(self._tokenizer).extract_tool_calls(answer, None)
        if extracted.tools_called:
            calls = extracted.tool_calls
            return "", [_call(call.function.name, call.function.arguments) for call in calls]
        return answer[self._sent :], None

    def _parse_forced(self, answer: str) -> list[ToolCall] | None:
        # Held to the schema, the answer fails to parse only when max_tokens cut it short.
        choice = self._request.tool_choice
        try:
            if isinstance(choice, NamedToolChoice):
                return [_call(choice.function.name, json.loads(answer))]
            calls = _forced_calls.validate_json(answer)
            return [_call(call.name, call.parameters) for call in calls]
        except (ValueError, ValidationError):
            return None


class JsonStringEscaper:
    """Escapes raw control characters inside the strings of JSON text as it streams.

    JSON forbids them there, but xgrammar (0.2.8) lets a string with ``maxLength`` hold any
    character but a quote, a backslash, CR and LF, so a model may put a tab in one and the
    answer would not parse. Escaped, the string means the same and its length is unchanged.
    """

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> str:
        out = []
        for char in text:
            if self._in_string and not self._escaped and ord(char) < 0x20:
                out.append(JSON_ESCAPES.get(ord(char), f"\\u{ord(char):04x}"))
                continue
            out.append(char)
            if self._escaped:
                self._escaped = False
            elif char == "\\" and self._in_string:
                self._escaped = True
            elif char == '"':
                self._in_string = not self._in_string
        return "".join(out)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_text(token: str | None) -> str:
    return token if token is not None else ""


def token_logprobs(
    token_ids: Iterable[int], positions: Iterable[dict[int, Any]] | None, top: int
) -> list[TokenLogprob]:
    """OpenAI-shaped logprobs for the tokens of one DELTA output (vLLM's ``Logprob`` dicts
    hold the sampled token and the ``top`` most likely ones, each with its rank)."""
    if positions is None:
        return []
    items = []
    for token_id, candidates in zip(token_ids, positions, strict=False):
        sampled = candidates[token_id]
        ranked = sorted(
            (entry for entry in candidates.values() if (entry.rank or top + 1) <= top),
            key=lambda entry: entry.rank,
        )
        text = _token_text(sampled.decoded_token)
        items.append(
            TokenLogprob(
                token=text,
                logprob=_logprob(sampled.logprob),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=_token_text(entry.decoded_token),
                        logprob=_logprob(entry.logprob),
                        bytes=list(_token_text(entry.decoded_token).encode()),
                    )
                    for entry in ranked[:top]
                ],
            )
        )
    return items
