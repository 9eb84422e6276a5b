"""The usage ledger: what each tenant's jobs used, per UTC day, API key, model (or adapter) and
class.

A job is counted when its terminal event is written, by core/lua/publish_event.lua in the same
step (core/events.py ``EventLog``): a job has exactly one terminal event, so it is counted
exactly once, also when another worker continued it after its first one died (the continued
run writes the one terminal event) and when a write is sent again (the script answers a
stored event before it counts anything).

Layout (core/keys.py): one hash per queue, tenant and UTC day,
``{queue}:usage:<tenant>:<day>``, whose fields are ``<model>|<class>|<counter>``, or
``key=<name>|<model>|<class>|<counter>`` for a job sent with a named API key (the request's
``key_name``), and a set of the day's tenants, ``{queue}:usage-tenants:<day>``; both expire
EDGEQ_USAGE_KEEP_DAYS after their last write. A tenant or key name cannot hold ``:`` or ``|``
(TENANT_PATTERN), nor a class or counter ``|``; a model name may, so a field is split from its
right once its key is taken off. No text of a prompt or an answer is ever written here.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from edgeq.core.adapters import valid_name
from edgeq.core.keys import usage_key, usage_tenants_key
from edgeq.core.protocol import DoneEvent, ErrorEvent, record_request
from edgeq.core.scheduling import DEFAULT_PRIORITY, DEFAULT_TENANT, PRIORITIES, TENANT_PATTERN

#: The counters a row has besides its errors, in the order they are shown.
COUNTERS = (
    "requests", "done", "continued", "prompt_tokens", "completion_tokens",
    "queue_ms", "ttft_ms", "ttft_jobs",
)  # fmt: skip
#: A field's counter for the jobs that ended with an error: ``error:<code>``.
ERROR_PREFIX = "error:"
#: What separates a field's parts.
SEPARATOR = "|"
#: What starts a field of a job sent with a named API key: ``key=<name>|``.
KEY_PREFIX = "key="
#: The longest range of days ``read_usage`` reads at once.
MAX_DAYS = 366


@dataclass(frozen=True, slots=True)
class LedgerScope:
    """Where a job's usage is counted: its tenant, the model or adapter that answered it, its
    class as submitted (aging does not change it), and the name of the API key it was sent
    with ('': none)."""

    tenant: str
    model: str
    priority: str
    key: str = ""

    def field(self, counter: str) -> str:
        field = SEPARATOR.join((self.model, self.priority, counter))
        return f"{KEY_PREFIX}{self.key}{SEPARATOR}{field}" if self.key else field


def unanswered_scope(payload: bytes | None, model: str) -> LedgerScope | None:
    """Where a job that ends without a worker's answer (a client's cancel, ``worker_lost``,
    ``poison_job``) is counted, from its payload as it is in Redis: its tenant and class as
    the worker reads them (worker/wire.py: an invalid one counts to the default), and the
    adapter it names, else ``model``, the workers' EDGEQ_MODEL as they published it (a
    tenant's default adapter is applied on a worker only). None without a payload or a
    model: the end still settles its reservation, and is not in the ledger."""
    request = record_request(payload)
    if not request or not model:
        return None
    tenant = request.get("tenant")
    if not (isinstance(tenant, str) and re.fullmatch(TENANT_PATTERN, tenant)):
        tenant = DEFAULT_TENANT
    priority = request.get("priority")
    adapter = request.get("adapter")
    key = request.get("key_name")
    return LedgerScope(
        tenant,
        adapter if isinstance(adapter, str) and valid_name(adapter) else model,
        priority if priority in PRIORITIES else DEFAULT_PRIORITY,
        key if isinstance(key, str) and re.fullmatch(TENANT_PATTERN, key) else "",
    )


def queued_scope(queued_as: str | None, model: str) -> LedgerScope | None:
    """Where a job whose payload expired in the queue is counted: the tenant and class its
    claim found in the queue's tenant-of entry (``<band>:<tenant>``, worker/claim.py), and
    ``model`` (the adapter it named went with its payload)."""
    band, _, tenant = (queued_as or "").partition(":")
    if not tenant or not band.isdigit() or int(band) >= len(PRIORITIES) or not model:
        return None
    return LedgerScope(tenant, model, PRIORITIES[int(band)])


def usage_day(now_s: float) -> str:
    """The UTC day a moment counts to, as ``YYYY-MM-DD``."""
    return dt.datetime.fromtimestamp(now_s, dt.UTC).date().isoformat()


def ledger_counts(event: DoneEvent | ErrorEvent) -> dict[str, int]:
    """What one terminal event adds to its scope's counters (milliseconds rounded down)."""
    if isinstance(event, ErrorEvent):
        return {"requests": 1, f"{ERROR_PREFIX}{event.code}": 1}
    counts = {
        "requests": 1,
        "done": 1,
        "prompt_tokens": event.usage.prompt_tokens,
        "completion_tokens": event.usage.completion_tokens,
        "queue_ms": int(event.timings.queued_ms),
    }
    if event.continued:
        counts["continued"] = 1
    if event.timings.ttft_ms is not None:
        counts["ttft_ms"] = int(event.timings.ttft_ms)
        counts["ttft_jobs"] = 1
    return counts


def ledger_arguments(scope: LedgerScope, event: DoneEvent | ErrorEvent) -> list[str]:
    """The field, increment pairs of the publish script's ledger part."""
    pairs: list[str] = []
    for counter, amount in ledger_counts(event).items():
        pairs += [scope.field(counter), str(amount)]
    return pairs


class UsageRow(BaseModel):
    """One tenant's usage on one UTC day with one API key, model (or adapter) and class."""

    tenant: str
    day: str = Field(description="UTC day, YYYY-MM-DD")
    key: str | None = Field(None, description="the API key's name the jobs were sent with")
    model: str = Field(description="the model, or the LoRA adapter, that answered")
    priority: str = Field(description="the class the jobs were submitted in")
    requests: int = Field(0, description="jobs ended: done and errors together")
    done: int = 0
    continued: int = Field(0, description="done jobs another worker continued")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: int = Field(0, description="queue wait of the done jobs, summed")
    ttft_ms: int = Field(0, description="time to first token of ttft_jobs jobs, summed")
    ttft_jobs: int = 0
    errors: dict[str, int] = Field(default_factory=dict, description="error code -> jobs")


def rows_of(tenant: str, day: str, fields: dict[bytes, bytes]) -> list[UsageRow]:
    """A usage hash's fields as rows, one per API key, model and class, sorted (the jobs
    sent with no key first)."""
    rows: dict[tuple[str, str, str], UsageRow] = {}
    for raw_field, raw_count in fields.items():
        field, key = raw_field.decode(), ""
        if field.startswith(KEY_PREFIX):
            key, _, field = field.removeprefix(KEY_PREFIX).partition(SEPARATOR)
        parts = field.rsplit(SEPARATOR, 2)
        if len(parts) != 3:
            continue  # not a ledger field
        model, priority, counter = parts
        row = rows.setdefault(
            (key, model, priority),
            UsageRow(tenant=tenant, day=day, key=key or None, model=model, priority=priority),
        )
        count = int(raw_count)
        if counter.startswith(ERROR_PREFIX):
            row.errors[counter.removeprefix(ERROR_PREFIX)] = count
        elif counter in COUNTERS:
            setattr(row, counter, count)
    return [rows[key] for key in sorted(rows)]


def days_between(first: dt.date, last: dt.date) -> list[str]:
    """Every UTC day from ``first`` to ``last``, both included (ValueError past MAX_DAYS)."""
    if last < first:
        raise ValueError(f"the last day, {last}, is before the first, {first}")
    count = (last - first).days + 1
    if count > MAX_DAYS:
        raise ValueError(f"{count} days asked for; at most {MAX_DAYS} at once")
    return [(first + dt.timedelta(days=n)).isoformat() for n in range(count)]


async def read_usage(
    redis: Redis,
    queue: str,
    days: Sequence[str],
    *,
    tenants: Iterable[str] | None = None,
    key: str | None = None,
) -> list[UsageRow]:
    """The ledger's rows for ``days`` (``tenants``: only theirs; None: every tenant counted
    on each day; ``key``: only the jobs sent with that API key), by day, tenant, key, model
    and class."""
    wanted = None if tenants is None else sorted(set(tenants))
    async with redis.pipeline(transaction=False) as pipe:
        for day in days:
            pipe.smembers(usage_tenants_key(queue, day))
        indexes = await pipe.execute()
    pairs = [
        (day, tenant)
        for day, index in zip(days, indexes, strict=True)
        for tenant in (wanted if wanted is not None else sorted(t.decode() for t in index))
    ]
    async with redis.pipeline(transaction=False) as pipe:
        for day, tenant in pairs:
            pipe.hgetall(usage_key(queue, tenant, day))
        hashes = await pipe.execute()
    rows: list[UsageRow] = []
    for (day, tenant), fields in zip(pairs, hashes, strict=True):
        rows += rows_of(tenant, day, fields)
    return rows if key is None else [row for row in rows if row.key == key]
