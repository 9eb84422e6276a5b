"""Stored responses in Redis: the request a response was created with, kept per tenant for
EDGEQ_GATEWAY_RESPONSE_TTL_S, and, once its job ended, the job's events (the replay buffer
is kept only EDGEQ_REPLAY_TTL_S).

Keys (per queue ``{queue}``, per job ``<id>``; the gateway's own, beside core/keys.py's):

- ``edgeq:response:{<id>}``: hash, ``request`` (JSON) and, once ended, ``events`` (JSON list);
- ``{queue}:responses:open``: set of the job ids of stored responses not yet ended; every
  gateway process follows them (response_follower.py);
- ``edgeq:response-follow:{<id>}``: the lease of the one gateway process following it.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from edgeq.core.events import read_events
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, decode_event, encode_event

AnyEvent = DeltaEvent | DoneEvent | ErrorEvent


def response_key(job_id: str) -> str:
    return f"edgeq:response:{{{job_id}}}"


def open_key(queue: str) -> str:
    return f"{queue}:responses:open"


def follow_key(job_id: str) -> str:
    return f"edgeq:response-follow:{{{job_id}}}"


class ResponseStore:
    """The stored responses of one queue."""

    def __init__(self, redis: Redis, *, queue: str, ttl_s: float) -> None:
        self.redis = redis
        self.queue = queue
        self.ttl_ms = int(ttl_s * 1000)

    async def save(self, job_id: str, record: dict[str, Any]) -> None:
        """Store a new response's request and mark it open (to be followed to its end)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(response_key(job_id), "request", json.dumps(record))
            pipe.pexpire(response_key(job_id), self.ttl_ms)
            pipe.sadd(open_key(self.queue), job_id)
            await pipe.execute()

    async def load(self, job_id: str) -> tuple[dict[str, Any], list[AnyEvent] | None] | None:
        """The stored request and, if its job ended, its events; None if not stored."""
        request, events = await self.redis.hmget(response_key(job_id), ["request", "events"])
        if request is None:
            return None
        kept = None if events is None else [decode_event(raw) for raw in json.loads(events)]
        return json.loads(request), kept

    async def events(self, job_id: str, stored: list[AnyEvent] | None) -> list[AnyEvent]:
        """The job's events so far: the stored copy once it ended, else the replay buffer."""
        if stored is not None:
            return stored
        return await read_events(self.redis, job_id)

    async def finish(self, job_id: str, events: list[AnyEvent]) -> bool:
        """Keep an ended job's events with its request and take it off the open set; False
        if the response was deleted meanwhile (nothing is written then)."""
        key = response_key(job_id)
        if not await self.redis.exists(key):
            await self.redis.srem(open_key(self.queue), job_id)
            return False
        raw = json.dumps([encode_event(event).decode() for event in events])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "events", raw)
            pipe.srem(open_key(self.queue), job_id)
            await pipe.execute()
        return True

    async def delete(self, job_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(response_key(job_id))
            pipe.srem(open_key(self.queue), job_id)
            await pipe.execute()

    async def open_ids(self) -> list[str]:
        return [raw.decode() for raw in await self.redis.smembers(open_key(self.queue))]

    async def claim(self, job_id: str, owner: str, lease_ms: int) -> bool:
        """Take the lease to follow ``job_id``; False if another process holds it."""
        return bool(await self.redis.set(follow_key(job_id), owner, nx=True, px=lease_ms))

    async def renew(self, job_id: str, owner: str, lease_ms: int) -> bool:
        """Extend our lease; False if it ran out and another process took it."""
        holder = await self.redis.get(follow_key(job_id))
        if holder is not None and holder.decode() != owner:
            return False
        await self.redis.set(follow_key(job_id), owner, px=lease_ms)
        return True

    async def release(self, job_id: str) -> None:
        await self.redis.delete(follow_key(job_id))
