"""Each job's event log in Redis, and the one way events get into it.

Every event goes through one Lua script, so Redis itself keeps the wire contract, whoever
writes (the worker, a client cancelling, a reaper declaring a worker lost):

- ``seq`` is assigned by Redis from the length of the job's replay stream: gap-free;
- after a terminal event (``done`` or ``error``) nothing more is accepted: exactly one;
- a terminal event counts its outcome (``done`` or the error code) in the queue's per-minute
  tally that ``edgeq status`` reads (core/registry.py), settles the tokens the job reserved
  at admission against its tenant's limits (lua/settle.lua, core/limits.py; whoever writes
  it, so every end settles, once), and, when its writer knows the job's scope, counts its
  usage in the tenant's usage ledger (core/ledger.py);
- the event is appended to the replay stream ``edgeq:events:{<job_id>}`` (stream id
  ``<seq>-1``, so ``after_seq`` maps onto stream ids) and published on
  ``edgeq:stream:<job_id>`` in the same step: a reader that subscribes first and then reads
  the stream sees every event, none twice.

The braces in key names are Redis Cluster hash tags: a job's keys live in one slot.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from edgeq.core.batching import BatchedScript
from edgeq.core.errors import StreamClosed
from edgeq.core.keys import (
    events_key,
    limits_usage_prefix,
    outcomes_key,
    reservation_key,
    stream_channel,
    terminal_key,
    usage_key,
    usage_tenants_key,
)
from edgeq.core.ledger import LedgerScope, ledger_arguments, usage_day
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, decode_event
from edgeq.core.scripts import lua_script

# The JSON of an event is split around its seq, which the script writes: every event's JSON
# has its seq third (after type and job_id) and at least one field after it.
_SEQ_FIELD = b'"seq":%d,'

# A delta's JSON around its seq, written here: pydantic's model_dump_json took ~1.7 µs of the
# worker's event loop per delta where the C encoder of the standard library takes ~0.1 µs
# (timeit, 2-vCPU machine, 2026-12-06). The same bytes: tests/test_publisher.py checks them.
_encode_json = json.JSONEncoder(ensure_ascii=False).encode
_DELTA_TAIL_HEAD = b'"type":"delta","text":'

# KEYS, ARGV and replies: lua/publish_event.lua; the settlement it ends with: lua/settle.lua.
_PUBLISH = lua_script("settle", "publish_event")

AnyEvent = DeltaEvent | DoneEvent | ErrorEvent

#: Per-minute outcome tallies are kept this long, so "recent" can reach back an hour.
OUTCOME_RETENTION_S = 3900


_EVENTS_LOST = -2
_STREAM_TAKEN = -3


def _settlement(event: DoneEvent | ErrorEvent) -> tuple[str, str]:
    """The completion and prompt tokens a terminal event settles its job's reservation with:
    a done event's exact usage; an error, what was reserved (-1, -1: the reservation stands).
    Tokens a job streamed before an error are not known here (deltas carry text, not
    tokens), and giving them back would make a cancel just before the end a way round the
    limits; the script gives everything back to a job that wrote nothing before its error."""
    if isinstance(event, DoneEvent):
        return str(event.usage.completion_tokens), str(event.usage.prompt_tokens)
    return "-1", "-1"


class StreamTaken(StreamClosed):
    """Another run of the job (it was handed over while this one was only slow) wrote the
    stream's next event first: the stream is that run's now."""


class EventsLost(Exception):
    """Redis holds fewer of the job's events than were appended (it restarted without them,
    or a failover lost them): the writer resends from ``kept`` on."""

    def __init__(self, job_id: str, kept: int) -> None:
        super().__init__(f"job {job_id}: Redis keeps only its first {kept} events")
        self.job_id = job_id
        self.kept = kept


@functools.lru_cache(maxsize=4096)
def _stream_keys(job_id: str) -> tuple[str, str, str]:
    """A job's replay stream, terminal mark and channel: the keys of every event it publishes,
    built once per job, not per event."""
    return events_key(job_id), terminal_key(job_id), stream_channel(job_id)


def _event_json(event: AnyEvent) -> tuple[bytes, bytes]:
    """An event's JSON, split around its seq (which the script writes)."""
    if type(event) is DeltaEvent:
        head = b'{"job_id":%s,' % _encode_json(event.job_id).encode()
        return head, b"%s%s}" % (_DELTA_TAIL_HEAD, _encode_json(event.text).encode())
    raw = event.model_dump_json(exclude_none=True).encode()
    head, tail = raw.split(_SEQ_FIELD % event.seq, 1)
    return head, tail


@dataclass(frozen=True)
class Published:
    seq: int
    listeners: int  # subscribers that received it live (0: nobody is listening now)


class EventLog:
    """Appends events to jobs' logs (replay stream + pub/sub) through the publish script.

    Appends from all jobs that arrive while a round trip is in flight go out together in the
    next script call (core/batching.py). Each caller still awaits its own result, so per-job
    order and StreamClosed are unchanged.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        replay_ttl_s: float,
        queue: str | None = None,
        usage_keep_s: int | None = None,
    ) -> None:
        self._queue = queue  # where terminal outcomes are counted (None: not counted)
        # How long a day's usage ledger is kept (None: this writer keeps no ledger).
        self._usage_keep_s = usage_keep_s
        self._publish = BatchedScript(redis, _PUBLISH)
        self._ttl_ms = str(int(replay_ttl_s * 1000))

    def _arguments(
        self,
        event: AnyEvent,
        wanted: int,
        tenant: str | None,
        ledger: LedgerScope | None,
        ledger_keep_s: int | None,
    ) -> tuple[list[str], list[bytes | str]]:
        head, tail = _event_json(event)
        keys = list(_stream_keys(event.job_id))
        if isinstance(event, DeltaEvent):
            return keys, [head, tail, "0", self._ttl_ms, str(wanted)]
        args: list[bytes | str] = [head, tail, "1", self._ttl_ms, str(wanted)]
        if self._queue is not None:
            now_s = time.time()
            keys += [outcomes_key(self._queue, now_s), reservation_key(self._queue, event.job_id)]
            outcome = "done" if isinstance(event, DoneEvent) else event.code
            tenant = ledger.tenant if ledger is not None else tenant
            args += [outcome, str(OUTCOME_RETENTION_S), tenant or ""]
            args += [limits_usage_prefix(self._queue), *_settlement(event)]
            keep_s = ledger_keep_s if ledger_keep_s is not None else self._usage_keep_s
            if ledger is not None and keep_s:
                day = usage_day(now_s)
                keys += [usage_key(self._queue, ledger.tenant, day),
                         usage_tenants_key(self._queue, day)]  # fmt: skip
                args += [str(keep_s), *ledger_arguments(ledger, event)]
        return keys, args

    async def append(
        self,
        event: AnyEvent,
        *,
        ledger: LedgerScope | None = None,
        ledger_keep_s: int | None = None,
    ) -> Published:
        """Append one event (its ``seq`` is ignored: Redis assigns it)."""
        return (
            await self.append_many([event], ledger=ledger, ledger_keep_s=ledger_keep_s)
        )[0]

    async def append_many(
        self,
        events: list[AnyEvent],
        *,
        at_seq: bool = False,
        tenant: str | None = None,
        ledger: LedgerScope | None = None,
        ledger_keep_s: int | None = None,
    ) -> list[Published]:
        """Append several events of one job, in order, in one round trip. With ``at_seq``
        each goes at its own ``seq`` (the job's one publisher numbers its events), so sending
        the same events again after a lost reply changes nothing; else Redis numbers them.
        ``tenant``: the job's, to count a terminal outcome per tenant too; ``ledger``: the
        job's scope, to count a terminal event in the usage ledger (its tenant wins);
        ``ledger_keep_s``: how long the ledger keeps it, for a writer built without
        ``usage_keep_s`` (a client cancelling: the workers' EDGEQ_USAGE_KEEP_DAYS as they
        published it in the tenancy hash, core/scheduling.py ``Tenancy``; 0: no ledger). A
        terminal event settles the job's reservation whether or not its writer knows the
        job (lua/settle.lua)."""
        calls = [
            self._arguments(event, event.seq if at_seq else -1, tenant, ledger, ledger_keep_s)
            for event in events
        ]
        replies = await self._publish.call_many(calls)
        for seq, length in replies:
            if seq == _EVENTS_LOST:
                raise EventsLost(events[0].job_id, int(length))
            if seq == _STREAM_TAKEN:
                raise StreamTaken(events[0].job_id)
            if seq < 0:
                raise StreamClosed(events[0].job_id)
        return [Published(seq=int(seq), listeners=int(listeners)) for seq, listeners in replies]


async def read_events(redis: Redis, job_id: str, after_seq: int = -1) -> list[AnyEvent]:
    """The events kept for a job with ``seq > after_seq``, in order."""
    start = f"({after_seq}-1" if after_seq >= 0 else "-"
    entries = await redis.xrange(events_key(job_id), min=start, max="+")
    return [decode_event(fields[b"event"]) for _, fields in entries]


async def finished_with(redis: Redis, job_id: str) -> AnyEvent | None:
    """The job's terminal event if its stream has ended (and is still kept), else None."""
    if not await redis.exists(terminal_key(job_id)):
        return None
    entries = await redis.xrevrange(events_key(job_id), count=1)
    return decode_event(entries[0][1][b"event"]) if entries else None
