"""The async client a backend service uses to submit chats and read their streams.

    async with ChatClient() as client:                 # settings from EDGEQ_* / .env
        job = await client.submit("Why is the sky blue?", max_tokens=64)
        async for event in job.stream():
            ...
        answer = await job.result()

``submit`` subscribes to the job's channel and enqueues at once, without waiting for Redis to
confirm the subscription: a stream that misses events (published before the subscription
took effect, during a dropped connection, or before a late reader came) fills the gap from the
job's replay buffer, so it is always complete, in order, with no duplicates. All of a client's
streams share one pub/sub connection (``StreamSubscriptions``), and its commands a small
bounded pool (``EDGEQ_CLIENT_MAX_CONNECTIONS``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, overload

from pydantic import ValidationError

from edgeq.core.adapters import known_adapter
from edgeq.core.connection import make_redis, redis_errors
from edgeq.core.errors import (
    EdgeqError,
    IdempotencyConflict,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    PoisonRefused,
    QueueFull,
    RateLimited,
    RedisUnavailable,
    StreamBroken,
)
from edgeq.core.events import EventLog, finished_with, read_events
from edgeq.core.fingerprint import request_fingerprint
from edgeq.core.keys import idempotency_key as idempotency_key_name
from edgeq.core.keys import new_job_id
from edgeq.core.leases import abandoned, declare_lost, hand_over, lease_expired
from edgeq.core.protocol import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    StreamEvent,
    decode_event,
    describe_validation_error,
    job_payload,
)
from edgeq.core.settings import ConnectionSettings, load_settings
from edgeq.core.structured import ModelT, json_schema_format, parse_answer
from edgeq.producer.queue import (
    IDEMPOTENCY_KEY_PATTERN,
    Enqueued,
    Idempotency,
    JobQueue,
    request_hash,
)
from edgeq.producer.subscriptions import REPLAY, StreamSubscriptions

# While a stream is idle, how often to check that the job's worker still holds its lease.
LEASE_CHECK_INTERVAL_S = 1.0
# After a dropped connection, how long to wait between attempts to get the streams back.
RECONNECT_DELAY_S = 0.25

MessagesLike = str | ChatRequest | Sequence[ChatMessage | Mapping[str, Any]]


def build_request(messages: MessagesLike, **fields: Any) -> ChatRequest:
    """A validated ChatRequest from a prompt string, a message list or a request."""
    if isinstance(messages, ChatRequest):
        data = messages.model_dump(exclude_none=True) | fields
    elif isinstance(messages, str):
        data = {"messages": [{"role": "user", "content": messages}], **fields}
    else:
        data = {"messages": list(messages), **fields}
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as error:
        raise InvalidRequest(describe_validation_error(error)) from None


class ChatJob:
    """A chat job's stream: read it once with ``stream()``, or just await ``result()``."""

    def __init__(
        self,
        client: ChatClient,
        job_id: str,
        inbox: asyncio.Queue[bytes],
        after_seq: int,
        *,
        submitted: bool = False,
    ) -> None:
        self.job_id = job_id
        self._client = client
        self._inbox = inbox  # what the client's pub/sub connection received on our channel
        self._last_seq = after_seq
        self._backlog: list[StreamEvent] = []
        self._text: list[str] = []
        self._terminal: DoneEvent | ErrorEvent | None = None
        self._closed = False
        # A replay the subscription asked for (see StreamSubscriptions) not done yet: Redis
        # was away, or the job was just submitted (below). Done when the stream next falls
        # silent, unless an event arriving in order shows that nothing was missed.
        self._replay_due = False
        # A job this client just enqueued was subscribed to first, so its worker, which can
        # only take it after the enqueue, publishes after the subscription took effect: the
        # first replay is left until silence or a gap. A burst of 50 submits then costs no
        # 50 replay-buffer reads while the worker starts the jobs (traced on a 2-vCPU machine,
        # 2026-12-05: they ran until 16-17 ms into a burst, with nothing to find).
        self._replay_when_silent = submitted
        self._unavailable: RedisUnavailable | None = None

    async def stream(self) -> AsyncIterator[StreamEvent]:
        """Yield the job's events after ``after_seq`` in order, ending with its terminal event."""
        if self._closed and self._terminal is None:
            raise EdgeqError(f"job {self.job_id}: the stream was closed before it ended")
        try:
            while self._terminal is None:
                event = await self._next_event()
                self._last_seq = event.seq
                if isinstance(event, DeltaEvent):
                    self._text.append(event.text)
                else:
                    self._terminal = event
                yield event
        finally:
            await self.aclose()

    async def result(self) -> ChatResult:
        """The whole answer (from ``after_seq`` on); raises JobFailed on an error event."""
        async for _ in self.stream():
            pass
        terminal = self._terminal
        if terminal is None:
            raise EdgeqError(f"job {self.job_id}: the stream was closed before it ended")
        if isinstance(terminal, ErrorEvent):
            raise JobFailed(self.job_id, terminal.code, terminal.message)
        return ChatResult.from_done(terminal, "".join(self._text))

    async def cancel(self, reason: str = "cancelled by the client") -> bool:
        """Stop the job (see ChatClient.cancel); its stream then ends with ``cancelled``."""
        return await self._client.cancel(self.job_id, reason)

    async def aclose(self) -> None:
        """Stop listening (the job itself goes on); safe to call more than once."""
        if not self._closed:
            self._closed = True
            await self._client.subscriptions.unsubscribe(self.job_id, self._inbox)

    async def _next_event(self) -> StreamEvent:
        settings = self._client.settings
        deadline = time.monotonic() + settings.stream_timeout_s
        while True:
            if self._backlog:
                return self._backlog.pop(0)
            if time.monotonic() >= deadline:
                if self._unavailable is not None:  # Redis was away the whole time
                    raise self._unavailable
                raise JobTimeout(
                    self.job_id,
                    settings.stream_timeout_s,
                    "is a worker running and serving this queue? "
                    "(EDGEQ_STREAM_TIMEOUT_S sets the wait)",
                )
            if not self._inbox.empty():  # the usual case mid-stream: no timer needed
                raw = self._inbox.get_nowait()
            else:
                wait_s = min(LEASE_CHECK_INTERVAL_S, max(0.0, deadline - time.monotonic()))
                try:
                    # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes in
                    # the same loop turn as an item, and a gateway's reader must stop when
                    # its HTTP client leaves. An item the timeout interrupts stays queued.
                    async with asyncio.timeout(wait_s):
                        raw = await self._inbox.get()
                except TimeoutError:
                    await self._while_silent()
                    continue
            if raw == REPLAY:
                if self._replay_when_silent:
                    self._replay_when_silent, self._replay_due = False, True
                else:
                    await self._replay()
                continue
            event = self._decode(raw)
            if event.seq <= self._last_seq:
                continue  # already seen (a replayed event arriving live too)
            if event.seq > self._last_seq + 1:
                # Events were missed: the replay buffer has them. Redis away for that read
                # (a restart: the live event came on a connection made before the outage)
                # is survived like any replay: tried again on the next event or silence.
                await self._replay()
                continue
            # Events go out in seq order, so all before this one were seen: none was missed
            # (and Redis is there).
            self._replay_due = self._replay_when_silent = False
            self._unavailable = None
            return event

    def _decode(self, raw: bytes) -> StreamEvent:
        try:
            event = decode_event(raw)
        except ValidationError as error:
            raise StreamBroken(f"job {self.job_id}: undecodable event: {error}") from None
        if event.job_id != self.job_id:
            raise StreamBroken(f"job {self.job_id}: got an event of job {event.job_id}")
        return event

    async def _replay(self) -> None:
        """The subscription took effect (or came back): read what was published before it."""
        try:
            await self._backfill()
        except RedisUnavailable as error:  # survived until the stream's deadline
            self._unavailable, self._replay_due = error, True
        else:
            self._unavailable, self._replay_due = None, False

    async def _while_silent(self) -> None:
        """Nothing came for a while: check the job's worker is alive, and do a replay still
        due. Redis being away is survived until the stream's deadline."""
        if self._replay_due:
            await self._replay()
        if self._replay_due:
            return  # still away
        try:
            await self._check_worker_alive()
        except RedisUnavailable as error:
            self._unavailable = error
        else:
            self._unavailable = None

    async def _backfill(self) -> None:
        with redis_errors(self._client.settings.redis_url):
            events = await read_events(self._client.redis, self.job_id, self._last_seq)
        expected = self._last_seq + 1
        for event in events:
            if event.seq != expected:
                raise StreamBroken(
                    f"job {self.job_id}: event {expected} is gone from the replay buffer "
                    f"(kept EDGEQ_REPLAY_TTL_S)"
                )
            expected += 1
        self._backlog.extend(events)

    async def _check_worker_alive(self) -> None:
        """If the job's worker stopped renewing its lease, hand the job over to be continued
        (or end it with ``worker_lost``); if it was handed over and nobody took it before its
        payload expired, end it with ``worker_lost``."""
        client = self._client
        settings = client.settings
        with redis_errors(settings.redis_url):
            if await lease_expired(client.redis, settings.queue, self.job_id):
                await hand_over(
                    client.redis,
                    client.events,
                    self.job_id,
                    queue=settings.queue,
                    max_continuations=settings.max_continuations,
                    deadline_s=settings.continue_within_s,
                    lease_ttl_s=settings.lease_ttl_s,
                    dead_letter_ttl_s=settings.dead_letter_ttl_s,
                    poison_refuse_s=settings.poison_refuse_s,
                )
            elif await abandoned(client.redis, settings.queue, self.job_id):
                await declare_lost(
                    client.redis, client.events, self.job_id, queue=settings.queue,
                    why="no worker took it over within EDGEQ_CONTINUE_WITHIN_S",
                )  # fmt: skip


class ChatClient:
    """Submits chat jobs to edgeq's queue. One pooled Redis connection set per client."""

    def __init__(self, settings: ConnectionSettings | None = None, **overrides: Any) -> None:
        if settings is None:
            settings = load_settings(ConnectionSettings, **overrides)
        elif overrides:
            settings = settings.model_copy(update=overrides)
        self.settings = settings
        self.redis = make_redis(settings, max_connections=settings.client_max_connections)
        self.queue = JobQueue(self.redis, settings.queue)
        self.events = EventLog(self.redis, replay_ttl_s=settings.replay_ttl_s, queue=settings.queue)
        self.subscriptions = StreamSubscriptions(
            self.redis,
            read_timeout_s=LEASE_CHECK_INTERVAL_S,
            reconnect_delay_s=RECONNECT_DELAY_S,
        )

    @classmethod
    def from_url(cls, redis_url: str, **overrides: Any) -> ChatClient:
        return cls(redis_url=redis_url, **overrides)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.subscriptions.aclose()
        # The pool was handed to redis-py, which then leaves it open unless told to close it.
        await self.redis.aclose(close_connection_pool=True)

    async def submit(
        self,
        messages: MessagesLike,
        *,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> ChatJob:
        """Validate, subscribe to the job's channel, then enqueue (see the module doc).

        ``deadline_s`` (default EDGEQ_QUEUE_DEADLINE_S): a job not started by then ends with
        ``expired`` and never starts. ``priority=`` ("interactive", "default", "batch") and
        ``tenant=`` (default EDGEQ_TENANT) decide its place in the queue
        (edgeq.core.scheduling). ``adapter=`` names a LoRA adapter to answer with; one that no
        worker serves or will is refused here (InvalidRequest). Raises QueueFull when
        EDGEQ_MAX_QUEUE jobs are queued or running, or the tenant has its
        EDGEQ_TENANT_MAX_QUEUED queued; RateLimited (a QueueFull) when the tenant's rate limit
        or token budget is spent (docs/limits.md). PoisonRefused (an InvalidRequest) when the
        same request was quarantined as a poison job within EDGEQ_POISON_REFUSE_S
        (docs/dead-letter.md).

        ``idempotency_key``: a submit retried with the same key (per tenant) within
        EDGEQ_IDEMPOTENCY_TTL_S gets the job the first one enqueued, attached from its replay
        buffer, instead of a second job; the same key with a different request raises
        IdempotencyConflict.
        """
        settings = self.settings
        if idempotency_key is not None and not re.fullmatch(IDEMPOTENCY_KEY_PATTERN,
                                                            idempotency_key):  # fmt: skip
            raise InvalidRequest(
                f"idempotency_key: 1 to 255 visible ASCII characters, no spaces "
                f"(got {idempotency_key[:40]!r})"
            )
        request = build_request(messages, **fields)
        if request.tenant is None:
            request = request.model_copy(update={"tenant": settings.tenant})
        payload, problem = job_payload(request, settings)
        if problem:
            raise InvalidRequest(problem)
        if request.adapter is not None:
            await self._check_adapter(request.adapter)
        job_id = new_job_id(settings.queue)
        tenant = request.tenant or settings.tenant
        idempotency = None
        if idempotency_key is not None:
            idempotency = Idempotency(
                idempotency_key_name(settings.queue, tenant, idempotency_key),
                request_hash(payload),
                settings.idempotency_ttl_s,
            )
        # The enqueue waits for the SUBSCRIBE to be written, not for a loop turn after it: both
        # go out in the next turn, the SUBSCRIBE first (and the enqueue not at all if it fails).
        inbox, subscribed = self.subscriptions.subscribe_soon(job_id)
        job = ChatJob(self, job_id, inbox, after_seq=-1, submitted=True)
        try:
            with redis_errors(settings.redis_url):
                outcome, detail = await self.queue.enqueue(
                    job_id,
                    payload,
                    deadline_s=deadline_s if deadline_s is not None else settings.queue_deadline_s,
                    max_depth=settings.max_queue,
                    tenant=tenant,
                    priority=request.priority,
                    after=subscribed,
                    idempotency=idempotency,
                    fingerprint=request_fingerprint(payload) if settings.poison_refuse_s else None,
                    key_name=request.key_name,
                )
        except BaseException:
            await job.aclose()
            raise
        if outcome is Enqueued.ACCEPTED:
            return job
        await job.aclose()
        if outcome is Enqueued.EXISTING:  # a retried submit: the first one's job
            return await self.attach(str(detail))
        raise self._refused(outcome, detail, tenant, idempotency_key, request.key_name)

    def _refused(
        self,
        outcome: Enqueued,
        detail: Any,
        tenant: str,
        idempotency_key: str | None,
        key_name: str | None,
    ) -> EdgeqError:
        """What a submit the enqueue refused raises."""
        if outcome is Enqueued.IDEMPOTENCY_CONFLICT:
            return IdempotencyConflict(str(idempotency_key), tenant, str(detail))
        if outcome is Enqueued.RATE_LIMITED:
            return RateLimited(tenant, detail, key_name)
        if outcome is Enqueued.POISON_REFUSED:
            return PoisonRefused(detail.job_id, detail.fingerprint, detail.left_s)
        if outcome is Enqueued.TENANT_FULL:
            return QueueFull(
                f"tenant {tenant} already has {detail} jobs queued "
                f"(its EDGEQ_TENANT_MAX_QUEUED on the workers); try again shortly"
            )
        return QueueFull(
            f"queue {self.settings.queue} already holds {self.settings.max_queue} jobs "
            f"(EDGEQ_MAX_QUEUE); try again shortly"
        )

    async def _check_adapter(self, name: str) -> None:
        """Refuse an adapter no worker of the queue serves or will (core/adapters.py)."""
        with redis_errors(self.settings.redis_url):
            if await known_adapter(self.redis, self.settings.queue, name):
                return
        raise InvalidRequest(
            f"adapter: {name!r} is not an adapter of queue {self.settings.queue}: it is not "
            f"registered (`edgeq adapters list`) and no live worker serves it"
        )

    @overload
    async def chat(
        self, messages: MessagesLike, *, schema: None = None, **fields: Any
    ) -> ChatResult: ...
    @overload
    async def chat(
        self, messages: MessagesLike, *, schema: type[ModelT], **fields: Any
    ) -> ModelT: ...
    async def chat(
        self, messages: MessagesLike, *, schema: type[ModelT] | None = None, **fields: Any
    ) -> ChatResult | ModelT:
        """Submit and wait for the whole answer. With ``schema`` (a pydantic model) the answer
        is held to the model's JSON Schema and returned as an instance of it (InvalidAnswer
        if it was cut short)."""
        if schema is not None:
            fields["response_format"] = json_schema_format(schema)
        job = await self.submit(messages, **fields)
        result = await job.result()
        return result if schema is None else parse_answer(result, schema)

    async def attach(self, job_id: str, *, after_seq: int = -1) -> ChatJob:
        """Follow an existing job from ``after_seq`` on: what was published is replayed from the
        job's buffer (kept EDGEQ_REPLAY_TTL_S), then the stream follows live, with no gap and
        no duplicate. Works after the job finished, until its buffer expires."""
        with redis_errors(self.settings.redis_url):
            inbox = await self.subscriptions.subscribe(job_id)
        job = ChatJob(self, job_id, inbox, after_seq=after_seq)
        try:
            await job._backfill()
            if not job._backlog:  # nothing after after_seq: maybe the stream already ended
                with redis_errors(self.settings.redis_url):
                    terminal = await finished_with(self.redis, job_id)
                if isinstance(terminal, DoneEvent | ErrorEvent) and terminal.seq <= after_seq:
                    job._terminal = terminal
        except BaseException:
            await job.aclose()
            raise
        return job

    async def cancel(self, job_id: str, reason: str = "cancelled by the client") -> bool:
        """End a job with ``cancelled``: a queued job never starts, a running one is aborted in
        the engine. False if it had already ended."""
        with redis_errors(self.settings.redis_url):
            return await self.queue.cancel(self.events, job_id, reason)
