"""A request's fingerprint, and refusing at the door a request that was quarantined (#41).

When a poison job is quarantined (core/leases.py hand_over, lua/hand_over.lua), the
fingerprint of its request is recorded for EDGEQ_POISON_REFUSE_S in
``{queue}:poison-refused:<fingerprint>`` (core/keys.py); the enqueue script (lua/enqueue.lua)
refuses a submit whose fingerprint is recorded there, in the same atomic step as every other
admission check. ``edgeq dead-letter retry`` and ``drop`` lift the refusal.

The fingerprint is the hex SHA-256 of the request's JSON (sorted keys, no spaces, UTF-8 text:
the idempotency hash's recipe, producer/queue.py request_hash) without the fields that only
decide delivery and scheduling (``DELIVERY_FIELDS``) and without fields set to null. What is
left is what decides what the engine computes: the messages, the adapter, the constraints
(response_format, constraint, tools, tool_choice, parallel_tool_calls), and every sampling
field (temperature, top_p, max_tokens, stop, seed, enable_thinking, logprobs, top_logprobs).
The sampling fields are in on purpose: a crash can hang on a seed (the test poison of
edgeq.testing.engine_poison does) or on how far a generation runs, and the refusal is there to
stop a client's unchanged retries, not a person who changes the request. The model is not in
the request: every worker of a queue serves one. The tenant and the API key's name are left
out: a poison request takes down engines every tenant shares, so the same request is refused
whoever sends it.

Both sides call ``request_fingerprint`` on the same dict: the producer on the request it
enqueues (the arq record's one argument), the quarantine on that argument read back from the
stored record. Producers in other languages follow docs/wire-contract.md ("Refused poison
requests"); one that passes no fingerprint is not checked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis

from edgeq.core.keys import dead_letter_entry_key, poison_refusal_key
from edgeq.core.protocol import record_request

#: Request fields that only decide how a job is delivered and scheduled, not what the engine
#: computes: left out of the fingerprint.
DELIVERY_FIELDS = frozenset(
    {"tenant", "key_name", "priority", "on_worker_lost", "stream", "return_reasoning"}
)


def request_fingerprint(request: Mapping[str, Any]) -> str:
    """The hex SHA-256 of the request's JSON without its delivery fields and null fields."""
    kept = {
        name: value
        for name, value in request.items()
        if name not in DELIVERY_FIELDS and value is not None
    }
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def record_fingerprint(payload: bytes | str | None) -> str | None:
    """The fingerprint of the request inside an arq job record (None: not a readable one)."""
    request = record_request(payload)
    return None if request is None else request_fingerprint(request)


async def refuse_quarantined(redis: Redis, queue: str, job_id: str, *, ttl_s: float) -> str | None:
    """Record the fingerprint of a job just quarantined (its record is in its dead-letter
    entry) for ``ttl_s``, so the same request is refused at the door; the fingerprint, or None
    (``ttl_s`` 0, or no readable record)."""
    if ttl_s <= 0:
        return None
    payload = await redis.hget(dead_letter_entry_key(queue, job_id), "payload")
    fingerprint = record_fingerprint(payload)
    if fingerprint is not None:
        await redis.set(poison_refusal_key(queue, fingerprint), job_id, px=int(ttl_s * 1000))
    return fingerprint


async def refusal_left_s(redis: Redis, queue: str, fingerprint: str) -> float:
    """How long the request of this fingerprint is still refused at the door (0: it is not)."""
    left_ms = await redis.pttl(poison_refusal_key(queue, fingerprint))
    return max(0, left_ms) / 1000


async def lift_refusal(redis: Redis, queue: str, fingerprint: str) -> bool:
    """Accept the request of this fingerprint again; False if it was not refused."""
    return bool(await redis.delete(poison_refusal_key(queue, fingerprint)))
