"""The body of ``POST /v1/responses`` (OpenAI's Responses API), as edgeq reads it: what
it may hold, refused by name where edgeq cannot honour it, and what it becomes: a chat
completion's fields (``chat_fields``) and the record kept with its job (``stored``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from edgeq.resources.openai_api import (
    InvalidField,
    Metadata,
    RequestBody,
    RequestPart,
    field_error,
)
from edgeq.resources.responses.store import StoredResponse

# --- the request body -----------------------------------------------------------------------------


class _Strict(RequestPart):
    # A field edgeq does not know is refused with a 400 naming it, never silently dropped.
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallInput(_Strict):
    type: Literal["function_call"]
    id: str | None = None
    status: str | None = None
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    id: str | None = None
    status: str | None = None
    call_id: str
    output: str


InputItem = FunctionCallInput | FunctionCallOutput | InputMessage


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


#: The input items and content parts edgeq reads; any other is refused by its name.
INPUT_ITEM_TYPES = (None, "message", "function_call", "function_call_output")
CONTENT_PART_TYPES = ("input_text", "output_text", "text")


class CreateResponse(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: Metadata | None = None
    previous_response_id: str | None = None
    user: str | None = None  # OpenAI's end-user tag: changes nothing in the answer
    seed: int | None = None  # edgeq's (and vLLM's) extension, sent as the SDK's extra_body

    @classmethod
    def check_raw(cls, data: Any) -> Any:
        """An input item or content part edgeq does not read (an image, a file, a reasoning
        item) is refused by name, not with every way the input's union failed to match it."""
        items = data.get("input") if isinstance(data, dict) else None
        for index, item in enumerate(items if isinstance(items, list) else ()):
            if not isinstance(item, dict):
                continue
            if item.get("type") not in INPUT_ITEM_TYPES:
                raise field_error(
                    f"input.{index}",
                    f"input.{index}: {item.get('type')!r} items are not supported by edgeq "
                    f"(messages, function_call and function_call_output items)",
                    code="unsupported",
                )
            content = item.get("content")
            for part_index, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_PART_TYPES:
                    where = f"input.{index}.content.{part_index}"
                    raise field_error(
                        where,
                        f"{where}: {kind} is not supported by edgeq (text parts only: input_text)",
                        code="unsupported",
                    )
        return data

    def messages(self) -> list[dict[str, Any]]:
        """The input as edgeq's chat messages (the instructions are not among them)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallOutput):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return messages

    def stored(self, job_id: str, tenant: str, history: list[dict[str, Any]]) -> StoredResponse:
        """What is kept of this request with its job (the conversation: ``history`` and the
        input, for a later previous_response_id to continue)."""
        return StoredResponse(
            job_id=job_id,
            created_at=time.time(),
            tenant=tenant,
            model=self.model,
            instructions=self.instructions,
            metadata=self.metadata,
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            text=self.text.model_dump(by_alias=True, exclude_none=True) if self.text else None,
            tools=[tool.model_dump(exclude_none=True) for tool in self.tools or ()],
            tool_choice=(
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice
            ),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            store=self.store,
            background=self.background,
            previous_response_id=self.previous_response_id,
            messages=history + self.messages(),
        )

    def chat_fields(self) -> dict[str, Any]:
        """The sampling, format and tool fields in the chat endpoint's spelling."""
        fields: dict[str, Any] = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            if form.schema_ is None:
                raise InvalidField(
                    "text.format.schema: a json_schema format needs a schema",
                    param="text.format.schema",
                )
            spec = {"name": form.name or "answer", "schema": form.schema_}
            if form.strict is not None:
                spec["strict"] = form.strict
            if form.description is not None:
                spec["description"] = form.description
            fields["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif form is not None and form.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        return {name: value for name, value in fields.items() if value is not None}
