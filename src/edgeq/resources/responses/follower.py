"""Who notices that a stored response ended when nobody is reading it: every gateway process
runs a ``ResponseFollower``, and each open response is followed by exactly one of them at a
time, the one holding its lease (renewed while it follows; a gateway that dies lets it run
out, and another process takes the response over).

When the response's job ends, its follower queues the response's webhook event, then keeps
the job's events with the stored request (the replay buffer is kept for less long) and takes it
off the open set. In that order: a follower that dies between the two steps leaves the
response open, so the next one queues the event again (the same webhook-id: at least once).
Following a job also watches its worker's lease (ChatJob does), so a background response whose
worker died is continued even with no HTTP client attached.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog

from edgeq.core.errors import EdgeqError
from edgeq.core.events import read_events
from edgeq.core.protocol import DoneEvent, ErrorEvent
from edgeq.core.tasks import cancel_and_wait
from edgeq.producer.client import ChatClient
from edgeq.resources.responses.events import final_state, response_id
from edgeq.resources.responses.store import ResponseStore
from edgeq.resources.settings import ResourceSettings
from edgeq.resources.webhooks import WebhookSender, enqueue_event

log = structlog.get_logger("edgeq.gateway")

SCAN_INTERVAL_S = 0.5


class ResponseFollower:
    def __init__(
        self,
        client: ChatClient,
        store: ResponseStore,
        settings: ResourceSettings,
        sender: WebhookSender | None = None,
    ) -> None:
        self.client = client
        self.sender = sender  # this process's, woken when an event is queued
        self.store = store
        self.settings = settings
        self.owner = uuid.uuid4().hex
        self.lease_ms = int(settings.gateway_response_lease_s * 1000)
        self.following: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self._scan()
                except Exception as error:  # Redis away: tried again on the next scan
                    log.warning("response_scan_failed", error=f"{type(error).__name__}: {error}")
                await asyncio.sleep(SCAN_INTERVAL_S)
        finally:
            await cancel_and_wait(*self.following.values())
            for job_id in list(self.following):  # let another gateway take them at once
                try:
                    await self.store.release(job_id)
                except Exception:  # the lease runs out on its own
                    pass

    async def _scan(self) -> None:
        for job_id in await self.store.open_ids():
            await self.adopt(job_id)

    async def adopt(self, job_id: str) -> None:
        """Follow ``job_id`` unless this or another process does already. The process that
        stores a response adopts it at once, so a short one is not left to the next scan."""
        if job_id in self.following:
            return
        if not await self.store.claim(job_id, self.owner, self.lease_ms):
            return
        task = asyncio.create_task(self._follow(job_id))
        self.following[job_id] = task
        task.add_done_callback(lambda _, job_id=job_id: self.following.pop(job_id, None))

    async def _follow(self, job_id: str) -> None:
        renewing = asyncio.create_task(self._renew(job_id))
        bound = log.bind(job_id=job_id)
        try:
            while True:
                try:
                    if await self._until_ended(job_id):
                        return
                except EdgeqError as error:  # a stream timeout, Redis away: follow again
                    bound.info("response_follow_retry", error=str(error))
                    await asyncio.sleep(1.0)
        finally:
            await cancel_and_wait(renewing)

    async def _until_ended(self, job_id: str) -> bool:
        job = await self.client.attach(job_id)
        try:
            async for event in job.stream():
                if isinstance(event, DoneEvent | ErrorEvent):
                    break
        finally:
            await job.aclose()
        loaded = await self.store.load(job_id)
        if loaded is None:  # deleted or expired meanwhile
            await self.store.delete(job_id)
            await self.store.release(job_id)
            return True
        request, _ = loaded
        events = await read_events(self.client.redis, job_id)
        state = final_state(request, events)
        await enqueue_event(
            self.client.redis,
            self.settings,
            event_type=f"response.{state.status}",
            object_id=response_id(job_id),
            tenant=request.tenant,
        )
        if self.sender is not None:
            self.sender.wake()
        await self.store.finish(job_id, events)
        await self.store.release(job_id)
        log.info("response_ended", job_id=job_id, status=state.status)
        return True

    async def _renew(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                if not await self.store.renew(job_id, self.owner, self.lease_ms):
                    log.warning("response_follow_lost", job_id=job_id)
                    task = self.following.get(job_id)
                    if task is not None:
                        task.cancel()
                    return
            except Exception as error:  # Redis away: the next renewal tries again
                log.warning("response_renew_failed", job_id=job_id, error=str(error))


@asynccontextmanager
async def follow_responses(
    client: ChatClient, settings: ResourceSettings
) -> AsyncIterator[ResponseFollower]:
    """For the gateway's life: this process's follower (holding the response store) and
    webhook sender running in the background."""
    store = ResponseStore(client.redis, queue=settings.queue, ttl_s=settings.gateway_response_ttl_s)
    sender = WebhookSender(client.redis, settings) if settings.gateway_webhooks else None
    follower = ResponseFollower(client, store, settings, sender)
    tasks = [asyncio.create_task(follower.run())]
    if sender is not None:
        tasks.append(asyncio.create_task(sender.run()))
    try:
        yield follower
    finally:
        await cancel_and_wait(*tasks)
