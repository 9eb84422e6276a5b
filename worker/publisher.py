"""Publishing one job's stream: the first text at once, later text coalesced to at most one
delta per interval, and one terminal event. Redis assigns ``seq`` and refuses anything after
a terminal event (core/events.py), so a job cancelled or declared lost by someone else
learns it at its next publish (StreamClosed) and stops."""

from __future__ import annotations

import time
from collections.abc import Callable

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog, Published
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.core.structured import TokenLogprob, ToolCall

__all__ = ["StreamClosed", "StreamPublisher"]


class StreamPublisher:
    def __init__(
        self,
        log: EventLog,
        job_id: str,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._pending: list[str] = []
        self._last_flush: float | None = None
        self._last_heard = clock()
        self.closed = False

    @property
    def unheard_for_s(self) -> float:
        """How long no subscriber has received this job's events live."""
        return self._clock() - self._last_heard

    async def publish_text(self, text: str) -> None:
        """Queue text for the stream; publish it now if the interval since the last delta is up."""
        if self.closed:
            raise StreamClosed(self.job_id)
        if not text:
            return
        self._pending.append(text)
        now = self._clock()
        if self._last_flush is None or now - self._last_flush >= self._interval_s:
            self._last_flush = now
            self._heard(await self._append([self._take_delta()]))

    async def publish_done(
        self,
        *,
        finish_reason: str,
        usage: Usage,
        timings: Timings,
        reasoning: str | None = None,
        tool_calls: list[ToolCall] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> DoneEvent:
        """Flush what is pending, then end the stream with ``done``."""
        done = DoneEvent(
            job_id=self.job_id,
            seq=0,
            finish_reason=finish_reason,
            usage=usage,
            timings=timings,
            reasoning=reasoning,
            tool_calls=tool_calls,
            logprobs=logprobs,
        )
        return await self._publish_terminal(done)

    async def publish_error(self, code: str, message: str) -> ErrorEvent:
        """Flush what is pending (the text already produced stays delivered), then ``error``."""
        error = ErrorEvent(job_id=self.job_id, seq=0, code=code, message=message)
        return await self._publish_terminal(error)

    def _take_delta(self) -> DeltaEvent:
        event = DeltaEvent(job_id=self.job_id, seq=0, text="".join(self._pending))
        self._pending.clear()
        return event

    def _heard(self, published: list[Published]) -> None:
        if any(item.listeners for item in published):
            self._last_heard = self._clock()

    async def _append(self, events: list[DeltaEvent | DoneEvent | ErrorEvent]) -> list[Published]:
        try:
            return await self._log.append_many(events)
        except StreamClosed:
            self.closed = True
            raise

    async def _publish_terminal(self, terminal: DoneEvent | ErrorEvent) -> DoneEvent | ErrorEvent:
        if self.closed:
            raise StreamClosed(self.job_id)
        events: list[DeltaEvent | DoneEvent | ErrorEvent] = []
        if self._pending:
            events.append(self._take_delta())
        events.append(terminal)
        # One round trip for the tail of the stream, in order.
        published = await self._append(events)
        self.closed = True
        return terminal.model_copy(update={"seq": published[-1].seq})
