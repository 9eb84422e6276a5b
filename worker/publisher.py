"""Publishing one job's stream: gap-free seq numbers, the first text at once, later text
coalesced to at most one delta per interval, and exactly one terminal event."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from redis.asyncio import Redis

from producer.protocol import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Timings,
    Usage,
    encode_event,
    stream_channel,
)

TerminalT = TypeVar("TerminalT", DoneEvent, ErrorEvent)


class StreamClosed(Exception):
    """A terminal event was already published for this job."""


class StreamPublisher:
    def __init__(
        self,
        redis: Redis,
        job_id: str,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self.channel = stream_channel(job_id)
        self._redis = redis
        self._interval_s = interval_s
        self._clock = clock
        self._seq = 0
        self._pending: list[str] = []
        self._last_flush: float | None = None
        self.closed = False

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
            await self._redis.publish(self.channel, encode_event(self._take_delta()))

    async def publish_done(
        self, *, finish_reason: str, usage: Usage, timings: Timings, reasoning: str | None
    ) -> DoneEvent:
        """Flush what is pending, then end the stream with ``done``."""
        return await self._publish_terminal(
            lambda seq: DoneEvent(
                job_id=self.job_id,
                seq=seq,
                finish_reason=finish_reason,
                usage=usage,
                timings=timings,
                reasoning=reasoning,
            )
        )

    async def publish_error(self, code: str, message: str) -> ErrorEvent:
        """Flush what is pending (the text already produced stays delivered), then ``error``."""
        return await self._publish_terminal(
            lambda seq: ErrorEvent(job_id=self.job_id, seq=seq, code=code, message=message)
        )

    def _take_delta(self) -> DeltaEvent:
        event = DeltaEvent(job_id=self.job_id, seq=self._seq, text="".join(self._pending))
        self._seq += 1
        self._pending.clear()
        return event

    async def _publish_terminal(self, build: Callable[[int], TerminalT]) -> TerminalT:
        if self.closed:
            raise StreamClosed(self.job_id)
        self.closed = True
        events: list[DeltaEvent | DoneEvent | ErrorEvent] = []
        if self._pending:
            events.append(self._take_delta())
        terminal = build(self._seq)
        self._seq += 1
        events.append(terminal)
        # One round trip for the tail of the stream; order within a pipeline is kept.
        async with self._redis.pipeline(transaction=False) as pipe:
            for event in events:
                pipe.publish(self.channel, encode_event(event))
            await pipe.execute()
        return terminal
