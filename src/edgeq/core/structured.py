"""Answers a program can use: JSON formats, other output constraints, tool calls, logprobs.

These are the optional parts of the wire contract (``edgeq.core.protocol`` uses them), spelt
the way OpenAI's chat completions spell them, so a request body an OpenAI SDK builds maps
onto them field for field:

- ``response_format``: ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``; the answer text is JSON (of that schema).
- ``constraint``: vLLM's other structured outputs, exactly one of ``regex``, ``choice``,
  ``grammar`` (an EBNF grammar as xgrammar reads it).
- ``tools`` and ``tool_choice``: OpenAI function definitions; calls come back parsed.
- ``logprobs`` / ``top_logprobs``: per generated token, in the done event.

A JSON Schema is checked against its meta-schema here, so a bad one is refused at submit
(``InvalidRequest``) in Python and again by the worker for producers in other languages.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Protocol, TypeVar

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from edgeq.core.errors import InvalidAnswer

ModelT = TypeVar("ModelT", bound=BaseModel)

#: OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: OpenAI accepts up to 20 alternatives per token.
MAX_TOP_LOGPROBS = 20


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` itself if it is a valid JSON Schema; else ValueError naming the problem."""
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "the schema's root"
        raise ValueError(f"not a valid JSON Schema at {where}: {error.message}") from None
    return schema


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- response formats ------------------------------------------------------------------------


class JsonSchemaSpec(_Wire):
    # "schema" would shadow a BaseModel attribute, so the field has another Python name.
    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)

    name: str = Field("answer", pattern=NAME_PATTERN)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    _check = field_validator("json_schema")(check_json_schema)


class TextFormat(_Wire):
    type: Literal["text"] = "text"


class JsonObjectFormat(_Wire):
    type: Literal["json_object"] = "json_object"


class JsonSchemaFormat(_Wire):
    type: Literal["json_schema"] = "json_schema"
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class Answer(Protocol):
    """What ``parse_answer`` reads of a whole answer (``edgeq.core.protocol.ChatResult`` is
    one): spelt here so that this module needs nothing of the protocol module, which needs it."""

    @property
    def job_id(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str: ...


def parse_answer(result: Answer, model: type[ModelT]) -> ModelT:
    """The answer of a ``json_schema_format(model)`` request (a ``ChatResult``) as a
    ``model`` instance."""
    if result.finish_reason != "stop":
        raise InvalidAnswer(
            f"job {result.job_id}: the answer ended with finish_reason={result.finish_reason!r} "
            f"before its JSON was complete; allow more max_tokens",
            result,
        )
    try:
        return model.model_validate_json(result.text)
    except ValidationError as error:
        raise InvalidAnswer(
            f"job {result.job_id}: the answer is not a valid {model.__name__}: "
            f"{error.errors()[0]['msg']} at {'.'.join(map(str, error.errors()[0]['loc']))}",
            result,
        ) from None


def json_schema_format(model: type[BaseModel]) -> JsonSchemaFormat:
    """The response format that makes the answer an instance of the pydantic ``model``."""
    spec = JsonSchemaSpec(name=model.__name__[:64], json_schema=model.model_json_schema())
    return JsonSchemaFormat(json_schema=spec)


class Constraint(_Wire):
    """vLLM's structured outputs beyond JSON: exactly one of the three."""

    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> Constraint:
        given = [name for name in ("regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of regex, choice or grammar (got {', '.join(given) or 'none'})"
            )
        return self


# --- tools -----------------------------------------------------------------------------------


class FunctionDefinition(_Wire):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(_Wire):
    name: str
    #: JSON text, as OpenAI sends it (``json.loads`` gives the arguments object).
    arguments: str

    @field_validator("arguments", mode="before")
    @classmethod
    def _object_as_text(cls, value: Any) -> Any:
        # History written by hand often holds the arguments as an object.
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionName(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# --- logprobs --------------------------------------------------------------------------------


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Wire):
    """One generated token, OpenAI's ``choices[].logprobs.content[]`` item."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []
