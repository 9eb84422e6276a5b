"""A response's stream events and its object, as pure functions of its job's events.

A response is one edgeq chat job (``resp_<job id>``). The job's events (deltas, then one
``done`` or ``error``, with gap-free ``seq``) live in Redis in its replay buffer, so the
Responses stream is computed from them, never stored: ``ResponseEvents`` turns the job's
events, in order, into OpenAI's stream events, numbering them as it goes. What it yields for
a job event depends only on the events before it and the stored request, so every gateway
process numbers every event the same way: a client that resumes with ``starting_after=N`` at
any process gets event N+1 next, none lost, none repeated.

    (always)      0 response.created, 1 response.in_progress
    first delta   response.output_item.added (the message), response.content_part.added
    each delta    response.output_text.delta
    done          the text's .done events, each function call as an item (added, arguments
                  delta and done, done), then response.completed (finish_reason "length":
                  response.incomplete)
    error         response.failed (status "cancelled" when the job was cancelled: the
                  Responses stream has no event of its own for it)
    (lost stream) ``error`` (error_event), when the gateway loses the job's stream; not
                  one of the response's events: it repeats the last one's number
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorCode, ErrorEvent
from edgeq.core.structured import ToolCall
from edgeq.resources.openai_api import encodable
from edgeq.resources.responses.store import StoredResponse

RESPONSE_PREFIX = "resp_"
Status = Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]
TERMINAL_STATUSES = ("completed", "failed", "cancelled", "incomplete")


def response_id(job_id: str) -> str:
    return f"{RESPONSE_PREFIX}{job_id}"


def job_id_of(response_id: str) -> str | None:
    """The job behind a response id, or None if it is not one of ours."""
    if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) > 200:
        return None
    return response_id[len(RESPONSE_PREFIX) :] or None


@dataclass
class ResponseState:
    """What the job's events so far say about the response."""

    status: Status = "queued"
    text: list[str] = field(default_factory=list)
    message_open: bool = False
    done: DoneEvent | None = None
    error: ErrorEvent | None = None

    @property
    def output_text(self) -> str:
        return "".join(self.text)


class ResponseEvents:
    """Numbers a response's stream events; feed it the job's events in seq order."""

    def __init__(self, request: StoredResponse) -> None:
        self.request = request
        self.job_id = request.job_id
        self.state = ResponseState()
        self.sequence = -1

    @property
    def message_id(self) -> str:
        return f"msg_{self.job_id}"

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": type, "sequence_number": self.sequence, **fields}

    def opening(self) -> list[dict[str, Any]]:
        """The two events every stream starts with, before the job has said anything."""
        snapshot = response_json(self.request, ResponseState(status="in_progress"))
        queued = response_json(self.request, ResponseState(status="queued"))
        return [
            self._event("response.created", response=queued),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, event: DeltaEvent | DoneEvent | ErrorEvent) -> list[dict[str, Any]]:
        state = self.state
        out: list[dict[str, Any]] = []
        if isinstance(event, DeltaEvent):
            state.status = "in_progress"
            if not event.text:
                return out
            if not state.message_open:
                out += self._open_message()
            state.text.append(event.text)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            )
            return out
        if isinstance(event, DoneEvent):
            state.done = event
            if state.message_open:
                out += self._close_message()
            first_call = 1 if state.message_open else 0
            for index, call in enumerate(event.tool_calls or ()):
                out += self._function_call(first_call + index, call)
            state.status = "incomplete" if event.finish_reason == "length" else "completed"
            kind = f"response.{state.status}"
        else:
            state.error = event
            state.status = "cancelled" if event.code == ErrorCode.CANCELLED else "failed"
            kind = "response.failed"
        out.append(self._event(kind, response=response_json(self.request, state)))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        self.state.message_open = True
        item = message_item(self.message_id, "", status="in_progress")
        item["content"] = []
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def _close_message(self) -> list[dict[str, Any]]:
        text = self.state.output_text
        return [
            self._event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=text_part(text),
            ),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=message_item(self.message_id, text, status="completed"),
            ),
        ]

    def _function_call(self, output_index: int, call: ToolCall) -> list[dict[str, Any]]:
        item = function_call_item(self.job_id, output_index, call)
        item_id = item["id"]
        return [
            self._event(
                "response.output_item.added",
                output_index=output_index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=output_index,
                delta=call.function.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=output_index,
                name=call.function.name,
                arguments=call.function.arguments,
            ),
            self._event("response.output_item.done", output_index=output_index, item=item),
        ]


def error_event(error: dict[str, Any], sequence_number: int) -> dict[str, Any]:
    """A stream's ``error`` event (OpenAI's ResponseErrorEvent, which its SDK yields as one)
    for an error body's fields (the gateway's errors.py). The body's own ``type``
    (``server_error``, ...) is left out: an event's ``type`` is what the SDK reads it as, and
    any other than
    ``error`` made it take the event for another kind and end the stream without a word."""
    return {
        "type": "error",
        "code": error.get("code"),
        "message": error["message"],
        "param": error.get("param"),
        "sequence_number": sequence_number,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, *, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)],
    }


def function_call_item(job_id: str, index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"fc_{job_id}_{index}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": "completed",
    }


def output_items(job_id: str, state: ResponseState) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if state.message_open:
        status = "in_progress" if state.status == "in_progress" else "completed"
        items.append(message_item(f"msg_{job_id}", state.output_text, status=status))
    calls = state.done.tool_calls if state.done is not None else None
    for call in calls or ():
        items.append(function_call_item(job_id, len(items), call))
    return items


def usage_json(done: DoneEvent) -> dict[str, Any]:
    usage = done.usage
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_json(request: StoredResponse, state: ResponseState) -> dict[str, Any]:
    """OpenAI's Response object for the stored ``request`` in ``state``."""
    error = None
    if state.error is not None and state.status == "failed":
        error = {"code": "server_error", "message": f"{state.error.code}: {state.error.message}"}
    incomplete = {"reason": "max_output_tokens"} if state.status == "incomplete" else None
    completed_at = None
    if state.done is not None:
        completed_at = request.created_at + state.done.timings.total_ms / 1000
    return {
        "id": response_id(request.job_id),
        "object": "response",
        "created_at": request.created_at,
        "status": state.status,
        "background": request.background,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        # A record stored before metadata was checked may hold a lone surrogate: shown as
        # U+FFFD, so the response can still be read.
        "metadata": encodable(request.metadata or {}),
        "model": request.model,
        "output": output_items(request.job_id, state),
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": usage_json(state.done) if state.done is not None else None,
        "user": None,
    }


def final_state(
    request: StoredResponse, events: list[DeltaEvent | DoneEvent | ErrorEvent]
) -> ResponseState:
    """The response's state after ``events`` (the job's, from seq 0, in order)."""
    mapper = ResponseEvents(request)
    for event in events:
        mapper.feed(event)
    return mapper.state
