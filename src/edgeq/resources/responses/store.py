"""Stored responses in Redis: the request a response was created with, kept per tenant for
EDGEQ_GATEWAY_RESPONSE_TTL_S, and, once its job ended, the job's events (the replay buffer
is kept only EDGEQ_REPLAY_TTL_S).

Keys (per queue ``{queue}``, per job ``<id>``; named in core/keys.py):

- ``edgeq:response:{<id>}``: hash, ``request`` (JSON) and, once ended, ``events`` (JSON list);
- ``{queue}:responses:open``: set of the job ids of stored responses not yet ended; every
  gateway process follows them (follower.py);
- ``edgeq:response-follow:{<id>}``: the lease of the one gateway process following it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from redis.asyncio import Redis

from edgeq.core.events import read_events
from edgeq.core.keys import open_responses_key, response_follow_key, response_key
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, decode_event, encode_event

AnyEvent = DeltaEvent | DoneEvent | ErrorEvent


class StoredResponse(BaseModel):
    """What a stored response was created with: its job, its owner, the request's fields its
    Response object shows, and the conversation a later ``previous_response_id`` continues.
    Kept as JSON in its hash's ``request`` field, in this field order."""

    job_id: str
    created_at: float
    tenant: str | None = None
    model: str
    instructions: str | None = None
    metadata: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: int | float | None = None  # as sent: 1 stays 1, not 1.0
    top_p: int | float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    store: bool
    background: bool
    previous_response_id: str | None = None
    #: The messages sent (the history and the input), not the answer.
    messages: list[dict[str, Any]] = []

    def stored_json(self) -> str:
        """The ``request`` field's value (json.dumps of every field, as it always was)."""
        return json.dumps(self.model_dump())


class ResponseStore:
    """The stored responses of one queue."""

    def __init__(self, redis: Redis, *, queue: str, ttl_s: float) -> None:
        self.redis = redis
        self.queue = queue
        self.ttl_ms = int(ttl_s * 1000)

    async def save(self, record: StoredResponse) -> None:
        """Store a new response's request and mark it open (to be followed to its end)."""
        job_id = record.job_id
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(response_key(job_id), "request", record.stored_json())
            pipe.pexpire(response_key(job_id), self.ttl_ms)
            pipe.sadd(open_responses_key(self.queue), job_id)
            await pipe.execute()

    async def load(self, job_id: str) -> tuple[StoredResponse, list[AnyEvent] | None] | None:
        """The stored request and, if its job ended, its events; None if not stored."""
        request, events = await self.redis.hmget(response_key(job_id), ["request", "events"])
        if request is None:
            return None
        kept = None if events is None else [decode_event(raw) for raw in json.loads(events)]
        # json.loads, not pydantic's parser: a record stored before metadata was checked may
        # hold a lone surrogate, which only the former reads (events.py shows it escaped).
        return StoredResponse.model_validate(json.loads(request)), kept

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
            await self.redis.srem(open_responses_key(self.queue), job_id)
            return False
        raw = json.dumps([encode_event(event).decode() for event in events])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "events", raw)
            pipe.srem(open_responses_key(self.queue), job_id)
            await pipe.execute()
        return True

    async def delete(self, job_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(response_key(job_id))
            pipe.srem(open_responses_key(self.queue), job_id)
            await pipe.execute()

    async def open_ids(self) -> list[str]:
        return [raw.decode() for raw in await self.redis.smembers(open_responses_key(self.queue))]

    async def claim(self, job_id: str, owner: str, lease_ms: int) -> bool:
        """Take the lease to follow ``job_id``; False if another process holds it."""
        return bool(await self.redis.set(response_follow_key(job_id), owner, nx=True, px=lease_ms))

    async def renew(self, job_id: str, owner: str, lease_ms: int) -> bool:
        """Extend our lease; False if it ran out and another process took it."""
        holder = await self.redis.get(response_follow_key(job_id))
        if holder is not None and holder.decode() != owner:
            return False
        await self.redis.set(response_follow_key(job_id), owner, px=lease_ms)
        return True

    async def release(self, job_id: str) -> None:
        await self.redis.delete(response_follow_key(job_id))
