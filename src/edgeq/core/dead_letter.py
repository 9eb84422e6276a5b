"""The dead-letter set: poison jobs, kept for a person to look at, send again or drop.

A job that was running at two engine failures is quarantined by its hand-over (core/leases.py,
lua/hand_over.lua): instead of being continued on a third engine, its arq record is copied,
in the same step, to ``{queue}:dead-letter:<id>`` (with the failure count and when), its id
added to the ``{queue}:dead-letter`` sorted set, and it ends with ``poison_job``. An entry
expires after EDGEQ_DEAD_LETTER_TTL_S; the index forgets expired entries as it is read and
written. ``edgeq dead-letter list | show | retry | drop`` (producer/dead_letter_commands.py)
is the operator's side.

The request's fingerprint (core/fingerprint.py) is recorded at the quarantine, and the same
request refused at the door, for EDGEQ_POISON_REFUSE_S; dropping an entry lifts that refusal
(a retry lifts it before it sends the request again).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from edgeq.core.fingerprint import refusal_left_s, request_fingerprint
from edgeq.core.keys import dead_letter_entry_key, dead_letter_key, poison_refusal_key
from edgeq.core.leases import redis_now_ms
from edgeq.core.protocol import record_request
from edgeq.core.scheduling import DEFAULT_TENANT

#: Why every entry is there (one reason today: the hand-over's).
QUARANTINE_REASON = "engine_failures"
#: What ``model`` shows for a request that named no adapter: the workers' own model.
BASE_MODEL = "(base model)"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One quarantined job."""

    job_id: str
    #: When it was quarantined (Unix ms, Redis's clock).
    at_ms: int
    #: The engine failures it was running at.
    failures: int
    #: Its request as it was enqueued (a dict; None if the record is not a readable arq job).
    request: dict[str, Any] | None
    #: How long the same request is still refused at the door (0: it is not).
    refused_s: float = 0.0

    @property
    def reason(self) -> str:
        return f"{QUARANTINE_REASON}={self.failures}"

    @property
    def tenant(self) -> str:
        tenant = (self.request or {}).get("tenant")
        return tenant if isinstance(tenant, str) else DEFAULT_TENANT

    @property
    def model(self) -> str:
        adapter = (self.request or {}).get("adapter")
        return adapter if isinstance(adapter, str) else BASE_MODEL

    @property
    def fingerprint(self) -> str | None:
        """Its request's fingerprint (core/fingerprint.py); None without a readable request."""
        return None if self.request is None else request_fingerprint(self.request)

    @property
    def when(self) -> str:
        return datetime.fromtimestamp(self.at_ms / 1000, UTC).isoformat(timespec="seconds")

    def summary(self, *, with_request: bool = False) -> dict[str, Any]:
        """What ``list`` and ``show`` print; the request (the prompt) only when asked."""
        shown: dict[str, Any] = {
            "job_id": self.job_id,
            "quarantined_at": self.when,
            "reason": self.reason,
            "tenant": self.tenant,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "refused_at_the_door_s": round(self.refused_s),
        }
        if with_request:
            shown["request"] = self.request
        return shown


async def _forget_expired(redis: Redis, queue: str, ttl_s: float) -> None:
    oldest_ms = await redis_now_ms(redis) - int(ttl_s * 1000)
    await redis.zremrangebyscore(dead_letter_key(queue), "-inf", oldest_ms)


async def read_dead_letter(redis: Redis, queue: str, job_id: str) -> DeadLetter | None:
    """The entry of a quarantined job, or None (never quarantined, expired or dropped)."""
    entry = await redis.hgetall(dead_letter_entry_key(queue, job_id))
    if not entry:
        return None
    letter = DeadLetter(
        job_id=job_id,
        at_ms=int(entry.get(b"at", b"0")),
        failures=int(entry.get(b"failures", b"0")),
        request=record_request(entry.get(b"payload")),
    )
    if (fingerprint := letter.fingerprint) is None:
        return letter
    return replace(letter, refused_s=await refusal_left_s(redis, queue, fingerprint))


async def list_dead_letters(redis: Redis, queue: str, *, ttl_s: float) -> list[DeadLetter]:
    """Every quarantined job still kept, oldest first."""
    await _forget_expired(redis, queue, ttl_s)
    letters = []
    for raw in await redis.zrange(dead_letter_key(queue), 0, -1):
        job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        if (letter := await read_dead_letter(redis, queue, job_id)) is not None:
            letters.append(letter)
        else:  # its entry expired before the index noticed
            await redis.zrem(dead_letter_key(queue), job_id)
    return letters


async def drop_dead_letter(redis: Redis, queue: str, job_id: str) -> bool:
    """Forget a quarantined job, and accept its request at the door again; False if it was
    not there."""
    payload = await redis.hget(dead_letter_entry_key(queue, job_id), "payload")
    request = record_request(payload)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(dead_letter_key(queue), job_id)
        pipe.delete(dead_letter_entry_key(queue, job_id))
        if request is not None:
            pipe.delete(poison_refusal_key(queue, request_fingerprint(request)))
        removed, deleted, *_ = await pipe.execute()
    return bool(removed or deleted)
