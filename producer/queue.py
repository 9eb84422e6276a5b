"""Putting jobs into arq's queue and taking them out again, atomically.

The enqueue is one Lua script instead of arq's WATCH/MULTI, because the depth check and the
enqueue must be one step: a burst of producers can never push the queue past its limit.
The job is stored exactly as arq expects it (README, "Wire contract").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from enum import IntEnum
from typing import Any, NamedTuple

from redis.asyncio import Redis

from edgeq.core.batching import BatchedScript
from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import (
    aging_key,
    batch_lines_key,
    fair_key,
    job_key,
    key_limits_usage_key,
    limits_usage_key,
    poison_refusal_key,
    queued_by_tenant_key,
    reservation_key,
    tenancy_key,
    tenant_of_key,
    wake_channel,
)
from edgeq.core.ledger import unanswered_scope
from edgeq.core.limits import RateLimitRefusal, estimate_prompt_tokens
from edgeq.core.protocol import JOB_FUNCTION, ErrorEvent, dump_json
from edgeq.core.scheduling import Priority, band_of
from edgeq.core.scripts import lua_script

# KEYS and ARGV: lua/enqueue.lua (it runs in a BatchedScript only: it wakes the workers once
# per batch) and lua/dequeue.lua; both use the fair-queuing functions (core/scheduling.py),
# the enqueue the tenants' limits too (core/limits.py).
_ENQUEUE = lua_script("clock", "fair_queuing", "limits", "enqueue")
_DEQUEUE = lua_script("fair_queuing", "dequeue")


#: An idempotency key as a caller may choose it: visible ASCII, no spaces, 1 to 255 of them.
IDEMPOTENCY_KEY_PATTERN = r"[!-~]{1,255}"


def request_hash(request: dict[str, Any]) -> str:
    """What tells two requests under one idempotency key apart: the hex SHA-256 of the
    request's JSON with sorted keys and no spaces (docs/wire-contract.md)."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Enqueued(IntEnum):
    ACCEPTED = 1
    QUEUE_FULL = 0
    DUPLICATE_ID = -1
    TENANT_FULL = -2
    #: The idempotency key was given to a job with the same request: that job is the answer.
    EXISTING = 2
    #: The idempotency key was given to a job with a different request.
    IDEMPOTENCY_CONFLICT = -3
    #: The tenant's rate limit or token budget is spent (core/limits.py).
    RATE_LIMITED = -4
    #: The tenant has limits and the call did not pass the keys to count them against.
    UNLIMITED_CALLER = -5
    #: The same request (its fingerprint: core/fingerprint.py) was quarantined as a poison
    #: job, within EDGEQ_POISON_REFUSE_S.
    POISON_REFUSED = -6


class Quarantined(NamedTuple):
    """Why a POISON_REFUSED request was refused: the quarantined job that had the same
    fingerprint, and how long the refusal still holds."""

    job_id: str
    fingerprint: str
    left_s: float


class EnqueueOutcome(NamedTuple):
    outcome: Enqueued
    #: The tenant's EDGEQ_TENANT_MAX_QUEUED for TENANT_FULL; the job the idempotency key was
    #: given to for EXISTING and IDEMPOTENCY_CONFLICT; which limit and what is left of it for
    #: RATE_LIMITED; the quarantined job for POISON_REFUSED (two fields: callers unpack a
    #: pair).
    detail: int | str | RateLimitRefusal | Quarantined = 0

    @property
    def tenant_cap(self) -> int:
        return self.detail if isinstance(self.detail, int) else 0

    @property
    def existing_job_id(self) -> str:
        return self.detail if isinstance(self.detail, str) else ""


class Idempotency(NamedTuple):
    """A submit's idempotency key (already scoped: core/keys.py idempotency_key), the hash
    of its request, and how long the key holds."""

    key: str
    request_hash: str
    ttl_s: float


class JobQueue:
    def __init__(self, redis: Redis, queue: str) -> None:
        self.name = queue
        self._redis = redis
        # Submits from many coroutines share one script call per loop turn (core/batching.py).
        self._enqueue = BatchedScript(redis, _ENQUEUE)
        self._dequeue = redis.register_script(_DEQUEUE)
        self._scheduling_keys = [
            fair_key(queue),
            tenant_of_key(queue),
            queued_by_tenant_key(queue),
            aging_key(queue),
            tenancy_key(queue),
        ]
        # Batch lines are left out of the depth interactive and default jobs are admitted
        # against (lua/enqueue.lua).
        self._batch_lines_key = batch_lines_key(queue)

    async def enqueue(
        self,
        job_id: str,
        request: dict[str, Any],
        *,
        deadline_s: float,
        max_depth: int,
        tenant: str,
        priority: Priority | None,
        after: asyncio.Future[Any] | None = None,
        idempotency: Idempotency | None = None,
        fingerprint: str | None = None,
        key_name: str | None = None,
    ) -> EnqueueOutcome:
        """Add a chat job unless the queue already holds ``max_depth`` jobs (0: no limit; the
        lines of batches are not counted for an interactive or default job) or the tenant has
        as many queued as its cap; its score puts it in its priority class and
        its tenant's fair share (core/scheduling.py).

        The job's payload expires after ``deadline_s``: a worker reaching it later finds it
        gone and ends it with ``expired`` instead of starting it late. ``after``: a future the
        enqueue is not sent before, and not at all if it fails (core/batching.py).
        ``idempotency``: a job already given its key is the answer (EXISTING), or a conflict
        if its request differs; nothing is enqueued then. ``fingerprint``
        (core/fingerprint.py): refused (POISON_REFUSED) while the same request's quarantine
        is recorded; None: not checked. ``key_name``: the API key the request came with,
        admitted against that key's limits too.
        """
        now_ms = time.time() * 1000
        # `et` to the microsecond, so queued_ms can show sub-millisecond pickup.
        job = {"f": JOB_FUNCTION, "a": [request], "k": {}, "t": 1, "et": round(now_ms, 3)}
        keys = [self.name, job_key(job_id), *self._scheduling_keys, self._batch_lines_key]
        args: list[Any] = [
            dump_json(job),
            int(deadline_s * 1000),
            max_depth,
            job_id,
            wake_channel(self.name),
            band_of(priority),
            tenant,
        ]
        if idempotency is not None:
            keys.append(idempotency.key)
            args += [idempotency.request_hash, int(idempotency.ttl_s * 1000)]
        else:  # a place holder in the queue's slot: no idempotency key (lua/enqueue.lua)
            keys.append(keys[1])
            args += ["", 0]
        # The tenant's limits (core/limits.py): admitted and reserved in the same step.
        keys += [limits_usage_key(self.name, tenant), reservation_key(self.name, job_id)]
        args += [estimate_prompt_tokens(request), int(request.get("max_tokens") or 0)]
        if fingerprint is not None or key_name:
            # No fingerprint: the empty one's refusal key, never set (lua/enqueue.lua).
            keys.append(poison_refusal_key(self.name, fingerprint or ""))
        if key_name:
            keys.append(key_limits_usage_key(self.name, key_name))
            args.append(key_name)
        reply = await self._enqueue(keys, args, after=after)
        outcome = Enqueued(int(reply[0]))
        if outcome is Enqueued.POISON_REFUSED:
            held = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            left_s = max(0, int(reply[2])) / 1000
            return EnqueueOutcome(outcome, Quarantined(held, str(fingerprint), left_s))
        if outcome in (Enqueued.EXISTING, Enqueued.IDEMPOTENCY_CONFLICT):
            held = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            return EnqueueOutcome(outcome, held)
        if outcome is Enqueued.RATE_LIMITED:
            return EnqueueOutcome(outcome, RateLimitRefusal.from_reply(reply[1:]))
        return EnqueueOutcome(outcome, *(int(value) for value in reply[1:]))

    async def depth(self) -> int:
        """Jobs accepted and not finished (arq keeps running jobs in the queue too)."""
        return int(await self._redis.zcard(self.name))

    async def cancel(self, log: EventLog, job_id: str, reason: str) -> bool:
        """End a job with ``cancelled``. A queued job never starts; a running one stops at
        its next event (its worker finds the stream closed and aborts the engine request).
        False if the job had already ended.

        The job leaves the queue before its stream ends, so whoever sees ``cancelled`` finds
        its place in the queue free (a job that had ended is gone from the queue anyway)."""
        payload, model, keep_s = await self._dequeue(
            keys=[self.name, job_key(job_id), *self._scheduling_keys], args=[job_id]
        )
        # Its end settles its reserved tokens and counts it in the usage ledger, in the
        # event's own step (core/events.py), under what its payload says.
        scope = unanswered_scope(payload, (model or b"").decode())
        event = ErrorEvent(job_id=job_id, seq=0, code="cancelled", message=reason)
        try:
            await log.append(event, ledger=scope, ledger_keep_s=int(keep_s or 0))
        except StreamClosed:
            return False
        return True
