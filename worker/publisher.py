"""Publishing one job's stream: the first text at once, later text coalesced to at most one
delta per interval, and one terminal event. A job that is not streamed (``ChatRequest.stream``
false) keeps its text here and publishes it as one delta right before its terminal event.

The publisher numbers its events itself and Redis stores each at that ``seq`` or refuses it
(core/events.py), which makes every append safe to repeat. So a Redis that goes away does not
end the chat: generation goes on, the events wait here in order, and they are sent again
until Redis is back (a restart, a failover) — those it already had are not stored twice, and
those it lost are sent again. Only an outage longer than ``outage_limit_s``
(``EDGEQ_REDIS_OUTAGE_S``) stops the job, with ``RedisAway``. Redis refuses
anything after a terminal event, so a job cancelled or declared lost by someone else learns it
at its next publish (StreamClosed) and stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.errors import StreamClosed
from edgeq.core.events import AnyEvent, EventLog, EventsLost, Published
from edgeq.core.ledger import LedgerScope
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent

__all__ = ["RedisAway", "StreamClosed", "StreamPublisher"]

log = structlog.get_logger("edgeq.publisher")

#: While Redis is away, how often the events waiting here are offered again.
RETRY_INTERVAL_S = 0.25


class RedisAway(Exception):
    """Redis stayed unreachable longer than the publisher's outage limit."""


class StreamPublisher:
    def __init__(
        self,
        log: EventLog,
        job_id: str,
        *,
        interval_s: float,
        live: bool = True,
        outage_limit_s: float = 10.0,
        earlier: list[AnyEvent] | None = None,
        tenant: str | None = None,
        ledger: LedgerScope | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self._tenant = tenant  # its terminal outcome is counted for this tenant too
        # Where its terminal event is counted in the usage ledger (core/ledger.py); the job
        # sets the model once it knows its adapter.
        self.ledger = ledger
        self._log = log
        self._interval_s = interval_s
        self.live = live
        self._outage_limit_s = outage_limit_s
        self._clock = clock
        self._pending: list[str] = []
        self._last_flush: float | None = None
        self._last_heard = clock()
        # ``earlier``: the events of the runs before this one (a continued job).
        self._stored: list[AnyEvent] = list(earlier or ())  # kept to refill a Redis that lost them
        self._next_seq = len(self._stored)
        self._unconfirmed: list[AnyEvent] = []  # numbered, not yet confirmed stored
        self._away_since: float | None = None
        self._retry_at = float("-inf")
        self.closed = False

    @property
    def redis_away_s(self) -> float:
        """How long Redis has refused this job's events (0 while it takes them)."""
        return 0.0 if self._away_since is None else self._clock() - self._away_since

    @property
    def stored(self) -> list[AnyEvent]:
        """The job's events Redis has confirmed, in order (earlier runs' included)."""
        return self._stored

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
        if not self.live:
            return  # published with the terminal event
        now = self._clock()
        if self._last_flush is None or now - self._last_flush >= self._interval_s:
            self._last_flush = now
            self._unconfirmed.append(self._take_delta())
            if now >= self._retry_at:
                await self._send(must_land=False)

    async def publish_done(self, done: DoneEvent) -> DoneEvent:
        """Flush what is pending, then end the stream with ``done`` (its ``seq`` is set here)."""
        return await self._publish_terminal(done)

    async def publish_error(self, code: str, message: str) -> ErrorEvent:
        """Flush what is pending (the text already produced stays delivered), then ``error``."""
        error = ErrorEvent(job_id=self.job_id, seq=0, code=code, message=message)
        return await self._publish_terminal(error)

    def _take_delta(self) -> DeltaEvent:
        """The pending text as the stream's next event, numbered."""
        event = DeltaEvent(job_id=self.job_id, seq=self._next_seq, text="".join(self._pending))
        self._next_seq += 1
        self._pending.clear()
        return event

    def _heard(self, published: list[Published]) -> None:
        if any(item.listeners for item in published):
            self._last_heard = self._clock()

    async def _send(self, *, must_land: bool) -> list[Published]:
        """Store the unconfirmed events, in order. Redis away: keep them and return [] (or,
        ``must_land``, try again until it is back); beyond the outage limit, RedisAway."""
        while True:
            try:
                published = await self._log.append_many(
                    self._unconfirmed, at_seq=True, tenant=self._tenant, ledger=self.ledger
                )
            except StreamClosed:
                self.closed = True
                raise
            except EventsLost as lost:  # Redis came back without some: send them again
                self._unconfirmed[:0] = self._stored[lost.kept :]
                del self._stored[lost.kept :]
                continue
            except REDIS_ERRORS as error:
                now = self._clock()
                if self._away_since is None:
                    self._away_since = now
                    log.warning(
                        "stream_events_held",
                        reason=f"{type(error).__name__}: {error}",
                        held=len(self._unconfirmed),
                        retry_every_s=RETRY_INTERVAL_S,
                    )
                if now - self._away_since > self._outage_limit_s:
                    raise RedisAway(
                        f"Redis refused this job's events for {now - self._away_since:.1f} s "
                        f"(longer than EDGEQ_REDIS_OUTAGE_S): {error}"
                    ) from None
                self._retry_at = now + RETRY_INTERVAL_S
                if not must_land:
                    return []
                await asyncio.sleep(RETRY_INTERVAL_S)
                continue
            if self._away_since is not None:
                log.info("stream_events_sent", held_s=round(self.redis_away_s, 3))
                self._away_since = None
            self._stored += self._unconfirmed
            self._unconfirmed = []
            self._heard(published)
            return published

    async def _publish_terminal(self, terminal: DoneEvent | ErrorEvent) -> DoneEvent | ErrorEvent:
        if self.closed:
            raise StreamClosed(self.job_id)
        if self._pending:
            self._unconfirmed.append(self._take_delta())
        self._unconfirmed.append(terminal.model_copy(update={"seq": self._next_seq}))
        self._next_seq += 1
        # One round trip for the tail of the stream (and whatever an outage held back), in order.
        published = await self._send(must_land=True)
        self.closed = True
        return terminal.model_copy(update={"seq": published[-1].seq})
