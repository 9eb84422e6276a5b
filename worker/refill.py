"""The jobs that finished in the last seconds, kept to write them again into a Redis that came
back without them.

Redis answers a write before it is on disk: with ``appendfsync everysec`` (deploy/
redis-edgeq.conf) a Redis killed loses up to about the last second of writes, and a replica
promoted by a failover may lack its last ones too. A running job finds out at its next publish
(core/events.py ``EventsLost``) and sends them again. A job that ended in that last second has
no next publish: its client had its terminal event live, but the replay buffer a reconnecting
reader refills from, arq's result and the lease's removal were gone (the CI chaos campaign:
"the live stream (3 events) differs from the replay buffer (2 events)" after a SIGKILL of
Redis). A lease brought back that way would even get the finished job continued.

So the worker keeps each finished job's events and the write of its records for
``EDGEQ_REFILL_WINDOW_S``, and each keep-alive round asks Redis who it is (INFO's ``run_id``):
the same server, and what was kept longer ago than the window is on its disk and forgotten; a
new one (a restart, a failover) and everything kept is written again. Both writes are
idempotent: events go at their own ``seq`` (core/lua/publish_event.lua keeps one already
there), arq's records by the same transaction as at the job's end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.asyncio import Redis

from edgeq.core.errors import StreamClosed
from edgeq.core.events import AnyEvent, EventLog, EventsLost
from edgeq.core.ledger import LedgerScope

log = structlog.get_logger("edgeq.refill")

RecordsWrite = Callable[[], Awaitable[None]]


@dataclass
class _Finished:
    at: float  # when the last of its writes was answered (time.monotonic)
    events: list[AnyEvent] = field(default_factory=list)
    tenant: str | None = None
    ledger: LedgerScope | None = None
    records: RecordsWrite | None = None


async def redis_run_id(redis: Redis) -> str:
    """Which Redis server answers: INFO's run_id, new at every start of a server (and so
    different after a failover; on a cluster the worker talks to its queue's primary)."""
    info: dict[str, Any] = await redis.info("server")
    return str(info["run_id"])


class RecentFinishes:
    """Finished jobs' events and records, kept ``window_s`` after Redis took them."""

    def __init__(
        self, events: EventLog, *, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._events = events
        self._window_s = window_s
        self._clock = clock
        self._kept: dict[str, _Finished] = {}
        self._run_id: str | None = None

    def __len__(self) -> int:
        return len(self._kept)

    def keep_events(
        self,
        job_id: str,
        events: list[AnyEvent],
        tenant: str | None,
        ledger: LedgerScope | None = None,
    ) -> None:
        """A job's whole stream (each event at its seq), once its terminal event is stored.
        ``ledger``: its scope, so a terminal event written again is counted again where Redis
        lost it (the ledger's increment went with it, written in the same step)."""
        if self._window_s > 0 and events:
            kept = self._kept.setdefault(job_id, _Finished(self._clock()))
            kept.at, kept.events, kept.tenant = self._clock(), list(events), tenant
            kept.ledger = ledger

    def keep_records(self, job_id: str, write: RecordsWrite) -> None:
        """The write of a job's records (worker/arq_seam.finish_job), once it was answered."""
        if self._window_s > 0:
            kept = self._kept.setdefault(job_id, _Finished(self._clock()))
            kept.at, kept.records = self._clock(), write

    async def refill_if_restarted(self, redis: Redis) -> int:
        """Write everything kept again if Redis is not the server that took it; forget what
        the same server has held for longer than the window. How many jobs were refilled."""
        asked = self._clock()
        run_id = await redis_run_id(redis)
        if self._run_id is None or run_id == self._run_id:
            self._run_id = run_id
            # Redis was up, unrestarted, at ``asked``: what it took a window before is on disk.
            self._kept = {
                job_id: kept for job_id, kept in self._kept.items()
                if kept.at > asked - self._window_s
            }  # fmt: skip
            return 0
        refilled = 0
        for job_id, kept in list(self._kept.items()):
            await self._write_again(job_id, kept)  # Redis errors: the next round tries again
            del self._kept[job_id]
            refilled += 1
        self._run_id = run_id
        if refilled:
            log.warning("finished_jobs_refilled", jobs=refilled, reason="Redis is a new server")
        return refilled

    async def _write_again(self, job_id: str, kept: _Finished) -> None:
        if kept.events:
            try:
                await self._events.append_many(
                    kept.events, at_seq=True, tenant=kept.tenant, ledger=kept.ledger
                )
            except (StreamClosed, EventsLost) as refused:
                # Someone ended or took the stream since (a cancel, a reaper, another run): it
                # is theirs now; the records below still end this run's claim on the job.
                log.info("refill_refused", job_id=job_id, reason=type(refused).__name__)
        if kept.records is not None:
            await kept.records()
