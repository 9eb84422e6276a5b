"""A streamed chat completion: a job's events as OpenAI's server-sent chunks.

The chunk sequence is OpenAI's: the role, content deltas, the finish chunk, the usage chunk if
asked, ``[DONE]``. An error after the first event (the route has already answered 200) is sent
as an ``error`` chunk, which OpenAI SDKs raise as APIError. A stream nobody reads to its end
(the client left, the gateway shut down) cancels its job, so the engine stops generating it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent

from edgeq.core.errors import EdgeqError
from edgeq.core.protocol import DeltaEvent, DoneEvent, StreamEvent, dump_json
from edgeq.gateway.errors import client_error, job_error
from edgeq.gateway.jobs import SHUTDOWN_REASON, CancellableJob, cancel_job, ms_since
from edgeq.resources.openai_api import (
    chunk_json,
    logprobs_json,
    now_s,
    tool_calls_json,
    usage_json,
)


class Chunks:
    """Builds one job's chunks: every chunk of a stream carries the same id, model and time."""

    def __init__(self, job_id: str, *, model: str, created: int) -> None:
        self.job_id = job_id
        self.model = model
        self.created = created

    def chunk(self, **fields: Any) -> ServerSentEvent:
        payload = chunk_json(self.job_id, model=self.model, created=self.created, **fields)
        return ServerSentEvent(data=dump_json(payload).decode())

    def finish(self, done: DoneEvent, *, include_usage: bool) -> list[ServerSentEvent]:
        """What a ``done`` event becomes: reasoning, tool calls, the finish chunk, usage."""
        chunks = []
        if done.reasoning is not None:
            chunks.append(self.chunk(delta={"reasoning_content": done.reasoning}))
        if done.tool_calls:  # final-only: every call whole, in one chunk
            calls = tool_calls_json(done.tool_calls, streamed=True)
            chunks.append(self.chunk(delta={"tool_calls": calls}))
        chunks.append(self.chunk(finish_reason=done.finish_reason, logprobs=logprobs_json(done)))
        if include_usage:
            chunks.append(self.chunk(usage=usage_json(done)))
        return chunks


def error_chunk(body: dict[str, Any]) -> ServerSentEvent:
    """An error in OpenAI's body shape, sent as a chunk of its own."""
    return ServerSentEvent(data=dump_json(body).decode())


async def sse_chunks(
    job: CancellableJob,
    first: StreamEvent,
    events: AsyncIterator[StreamEvent],
    *,
    model: str,
    include_usage: bool,
    started: float,
    log: Any,
    shutdown: anyio.Event,
) -> AsyncIterator[ServerSentEvent]:
    """The stream's chunks from ``first`` (already read) and the rest of ``events``; ``log``
    is the request's bound logger, ``shutdown`` set when the server began to stop."""
    chunks = Chunks(job.job_id, model=model, created=now_s())
    unfinished_because: str | None = "the HTTP client disconnected"
    try:
        yield chunks.chunk(delta={"role": "assistant", "content": ""})
        event: StreamEvent = first
        while True:
            if isinstance(event, DeltaEvent):
                if event.text:
                    yield chunks.chunk(delta={"content": event.text})
            elif isinstance(event, DoneEvent):
                unfinished_because = None
                for chunk in chunks.finish(event, include_usage=include_usage):
                    yield chunk
                log.info("gateway_done", total_ms=ms_since(started))
                break
            else:
                unfinished_because = None
                failure = job_error(event.code, event.message)
                yield error_chunk(failure.body)
                log.info("gateway_job_failed", status=failure.status, code=event.code)
                break
            event = await anext(events)
    except EdgeqError as error:
        unfinished_because = f"the gateway lost the job's stream: {error}"
        yield error_chunk(client_error(error).body)
    finally:
        if unfinished_because:  # nobody will read the rest: stop generating it
            if shutdown.is_set():
                unfinished_because = SHUTDOWN_REASON
            await cancel_job(job, unfinished_because)
            log.info("gateway_job_unfinished", reason=unfinished_because)
        with anyio.CancelScope(shield=True):
            await job.aclose()  # its pub/sub connection goes back now, not at GC
    yield ServerSentEvent(data="[DONE]")


def stream_response(
    job: CancellableJob,
    first: StreamEvent,
    events: AsyncIterator[StreamEvent],
    *,
    model: str,
    include_usage: bool,
    started: float,
    log: Any,
    headers: dict[str, str],
    shutdown_timeout_s: float,
) -> EventSourceResponse:
    """The streamed answer: ``sse_chunks`` as an HTTP response."""
    shutdown = anyio.Event()
    chunks = sse_chunks(
        job,
        first,
        events,
        model=model,
        include_usage=include_usage,
        started=started,
        log=log,
        shutdown=shutdown,
    )
    return EventSourceResponse(
        chunks,
        headers=headers,
        sep="\n",
        # On SIGTERM a stream may still finish for this long, then its job is cancelled.
        shutdown_event=shutdown,
        shutdown_grace_period=shutdown_timeout_s,
    )
