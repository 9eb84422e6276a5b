"""Signed webhooks for ended responses and batches: queued in Redis, delivered at least once.

Endpoints and their secrets are the operator's (EDGEQ_GATEWAY_WEBHOOKS; a tenant's endpoint
gets only that tenant's events), never a URL from a request. An event is OpenAI's payload
(``{"id", "type", "created_at", "data": {"id": <response or batch id>}, "object": "event"}``:
``response.completed`` … and ``batch.completed``, ``batch.failed``, ``batch.expired``,
``batch.cancelled``), signed the Standard Webhooks way, as ``openai``'s
``client.webhooks.unwrap()`` verifies it:
``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` keyed with the
secret (a ``whsec_`` secret base64-decoded).

Delivery: each (event, endpoint) is one member of a sorted set by next-attempt time, its body in
a hash, so a gateway that restarts loses none. Every gateway process polls the set; an attempt
is claimed by a short lock so only one process makes it. A failure (an error, a timeout, a
status other than 2xx) is retried with exponential backoff until EDGEQ_GATEWAY_WEBHOOK_RETRY_S
after the event, with the same ``webhook-id`` each time. Each endpoint has at most
EDGEQ_GATEWAY_WEBHOOK_CONCURRENCY attempts in flight per process, each in a task of its own:
a dead endpoint holds only its own slots, never another's or a chat's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import time
from typing import Any

import httpx
import structlog
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from edgeq.core.connection import redis_errors
from edgeq.core.errors import RedisUnavailable
from edgeq.core.keys import webhook_deliveries_key, webhook_lock_key, webhooks_due_key
from edgeq.core.tasks import cancel_and_wait
from edgeq.resources.settings import ResourceSettings, WebhookEndpoint

log = structlog.get_logger("edgeq.gateway")

POLL_INTERVAL_S = 0.1
#: Longest wait between two attempts, however many failed.
MAX_BACKOFF_S = 3600.0


def endpoint_tag(endpoint: WebhookEndpoint) -> str:
    """A short stable name for an endpoint (its URL's hash): the queue never holds its URL."""
    return hashlib.sha256(endpoint.url.encode()).hexdigest()[:16]


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value (Standard Webhooks, v1)."""
    key = (
        base64.b64decode(secret.removeprefix("whsec_"))
        if secret.startswith("whsec_")
        else (secret.encode())
    )
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def event_json(event_type: str, object_id: str, created_at: int) -> dict[str, Any]:
    """The event about a response (``resp_…``) or a batch (``batch_…``): one per object, as
    each ends once, so its id is derived from the object's."""
    return {
        "id": f"evt_{object_id.removeprefix('resp_')}",
        "type": event_type,
        "created_at": created_at,
        "data": {"id": object_id},
        "object": "event",
    }


def queue_event(
    pipe: Pipeline,
    settings: ResourceSettings,
    *,
    event_type: str,
    object_id: str,
    tenant: str | None,
) -> int:
    """Add to ``pipe`` the commands that queue ``event_type`` for every endpoint that takes
    ``tenant``'s events (so it lands with the change it announces); how many endpoints.
    Queuing the same event again (a writer that died after queuing it) changes nothing."""
    now = time.time()
    event = event_json(event_type, object_id, int(now))
    body = json.dumps(event, separators=(",", ":"))
    count = 0
    for endpoint in settings.gateway_webhooks:
        if endpoint.tenant is not None and endpoint.tenant != tenant:
            continue
        member = f"{endpoint_tag(endpoint)}:{event['id']}"
        record = {"body": body, "id": event["id"], "first_at": now, "attempts": 0}
        pipe.hsetnx(webhook_deliveries_key(settings.queue), member, json.dumps(record))
        pipe.zadd(webhooks_due_key(settings.queue), {member: now}, nx=True)
        count += 1
    return count


async def enqueue_event(
    redis: Redis,
    settings: ResourceSettings,
    *,
    event_type: str,
    object_id: str,
    tenant: str | None,
) -> int:
    """Queue ``event_type`` at once (see ``queue_event``); how many endpoints take it."""
    async with redis.pipeline(transaction=True) as pipe:
        count = queue_event(
            pipe, settings, event_type=event_type, object_id=object_id, tenant=tenant
        )
        if count:
            await pipe.execute()
    return count


class WebhookSender:
    """Delivers a queue's webhooks from this gateway process (see the module doc)."""

    def __init__(self, redis: Redis, settings: ResourceSettings) -> None:
        self.redis = redis
        self.settings = settings
        self.endpoints = {endpoint_tag(e): e for e in settings.gateway_webhooks}
        self.slots = {tag: asyncio.Semaphore(settings.gateway_webhook_concurrency)
                      for tag in self.endpoints}  # fmt: skip
        self.in_flight: set[str] = set()
        self.woken = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.http = httpx.AsyncClient(timeout=settings.gateway_webhook_timeout_s)
        # httpx logs each request with its URL at INFO; the sender logs its own events.
        logging.getLogger("httpx").setLevel(logging.WARNING)

    def wake(self) -> None:
        """An event was just queued by this process: poll now, not at the next interval."""
        self.woken.set()

    async def run(self) -> None:
        try:
            while True:
                self.woken.clear()
                try:
                    with redis_errors(self.settings.redis_url):
                        await self._poll()
                except RedisUnavailable as error:
                    log.warning("webhook_poll_failed", error=str(error))
                    await asyncio.sleep(1.0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_INTERVAL_S):
                        await self.woken.wait()
        finally:
            await cancel_and_wait(*self.tasks)
            await self.http.aclose()

    async def _poll(self) -> None:
        queue = self.settings.queue
        due = await self.redis.zrangebyscore(
            webhooks_due_key(queue), "-inf", time.time(), start=0, num=100
        )
        for raw in due:
            member = raw.decode()
            tag = member.partition(":")[0]
            slots = self.slots.get(tag)
            if member in self.in_flight or slots is None or slots.locked():
                continue  # an endpoint no longer configured here, or busy: left for later
            lock_ms = int((self.settings.gateway_webhook_timeout_s + 5) * 1000)
            if not await self.redis.set(webhook_lock_key(queue, member), "1", nx=True, px=lock_ms):
                continue  # another gateway process is making this attempt
            await slots.acquire()
            self.in_flight.add(member)
            task = asyncio.create_task(self._attempt(member, self.endpoints[tag], slots))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _attempt(
        self, member: str, endpoint: WebhookEndpoint, slots: asyncio.Semaphore
    ) -> None:
        queue = self.settings.queue
        bound = log.bind(webhook_id=member.partition(":")[2], endpoint=member.partition(":")[0])
        try:
            raw = await self.redis.hget(webhook_deliveries_key(queue), member)
            if raw is None:  # delivered by another process meanwhile
                await self.redis.zrem(webhooks_due_key(queue), member)
                return
            record = json.loads(raw)
            delivered, why = await self._post(endpoint, record)
            if delivered:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.zrem(webhooks_due_key(queue), member)
                    pipe.hdel(webhook_deliveries_key(queue), member)
                    await pipe.execute()
                bound.info("webhook_delivered", attempts=record["attempts"] + 1)
                return
            record["attempts"] += 1
            backoff = min(
                self.settings.gateway_webhook_backoff_s * 2 ** (record["attempts"] - 1),
                MAX_BACKOFF_S,
            )
            next_at = time.time() + backoff
            if next_at > record["first_at"] + self.settings.gateway_webhook_retry_s:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.zrem(webhooks_due_key(queue), member)
                    pipe.hdel(webhook_deliveries_key(queue), member)
                    await pipe.execute()
                bound.warning("webhook_given_up", attempts=record["attempts"], why=why)
                return
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(webhook_deliveries_key(queue), member, json.dumps(record))
                pipe.zadd(webhooks_due_key(queue), {member: next_at}, xx=True)
                await pipe.execute()
            bound.info("webhook_retry", attempts=record["attempts"], why=why, in_s=backoff)
        except Exception as error:  # Redis away: the lock runs out and the attempt is redone
            bound.warning("webhook_attempt_failed", error=f"{type(error).__name__}: {error}")
        finally:
            self.in_flight.discard(member)
            slots.release()
            try:
                await self.redis.delete(webhook_lock_key(queue, member))
            except Exception:  # the lock runs out on its own
                pass

    async def _post(self, endpoint: WebhookEndpoint, record: dict[str, Any]) -> tuple[bool, str]:
        body = record["body"].encode()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": "edgeq-webhooks",
            "webhook-id": record["id"],
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(endpoint.secret, record["id"], timestamp, body),
        }
        try:
            reply = await self.http.post(endpoint.url, content=body, headers=headers)
        except httpx.HTTPError as error:
            return False, f"{type(error).__name__}: {error}"
        if 200 <= reply.status_code < 300:
            return True, ""
        return False, f"HTTP {reply.status_code}"
