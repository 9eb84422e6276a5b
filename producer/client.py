"""The async client a backend service uses to submit chats and read their streams.

    async with ChatClient() as client:                 # settings from EDGEQ_* / .env
        job = await client.submit("Why is the sky blue?", max_tokens=64)
        async for event in job.stream():
            ...
        answer = await job.result()

``submit`` subscribes to the job's channel and waits for Redis to confirm the subscription
before it enqueues, so not even the first token can be published before anyone listens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis.exceptions
from arq.connections import ArqRedis
from pydantic import ValidationError
from redis.asyncio import ConnectionPool
from redis.asyncio.client import PubSub

from producer.errors import EdgeqError, JobFailed, JobTimeout, RedisUnavailable, StreamBroken
from producer.protocol import (
    JOB_FUNCTION,
    ChatMessage,
    ChatRequest,
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    StreamEvent,
    decode_event,
    describe_validation_error,
    dump_json,
    load_json,
    stream_channel,
)
from producer.settings import ConnectionSettings, load_settings, redacted_url

# A dead connection is noticed within this long even while a stream sits idle.
REDIS_HEALTH_CHECK_INTERVAL_S = 15

MessagesLike = str | ChatRequest | Sequence[ChatMessage | Mapping[str, Any]]


class InvalidRequest(EdgeqError, ValueError):
    """The request was refused before it was enqueued; the message names the field."""


def make_redis(
    settings: ConnectionSettings,
    *,
    job_serializer: Callable[[Any], bytes] = dump_json,
    job_deserializer: Callable[[bytes], Any] = load_json,
) -> ArqRedis:
    """One pooled client (arq's Redis subclass, JSON serializers) for a process or a client."""
    pool = ConnectionPool.from_url(
        settings.redis_url,
        socket_connect_timeout=settings.redis_connect_timeout_s,
        socket_timeout=settings.redis_socket_timeout_s,
        socket_keepalive=True,
        health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
    )
    return ArqRedis(
        pool,
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=settings.queue,
    )


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Turn redis-py's exceptions into RedisUnavailable with the (redacted) URL in the message."""
    try:
        yield
    except redis.exceptions.AuthenticationError as error:
        raise RedisUnavailable(
            f"Redis at {redacted_url(url)} refused the credentials: {error}"
        ) from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
        raise RedisUnavailable(f"cannot reach Redis at {redacted_url(url)}: {error}") from None


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
    """A submitted chat: read its events once with ``stream()``, or just await ``result()``."""

    def __init__(
        self, job_id: str, pubsub: PubSub, *, stream_timeout_s: float, redis_url: str
    ) -> None:
        self.job_id = job_id
        self._pubsub: PubSub | None = pubsub
        self._stream_timeout_s = stream_timeout_s
        self._redis_url = redis_url
        self._next_seq = 0
        self._text: list[str] = []
        self._terminal: DoneEvent | ErrorEvent | None = None

    async def stream(self) -> AsyncIterator[StreamEvent]:
        """Yield the job's events in order, ending with its one terminal event."""
        if self._terminal is not None:
            return
        if self._pubsub is None:
            raise EdgeqError(f"job {self.job_id}: the stream was closed before it ended")
        try:
            while self._terminal is None:
                event = await self._next_event(self._pubsub)
                if isinstance(event, DeltaEvent):
                    self._text.append(event.text)
                else:
                    self._terminal = event
                yield event
        finally:
            await self.aclose()

    async def result(self) -> ChatResult:
        """The whole answer; raises JobFailed if the job ended with an error event."""
        async for _ in self.stream():
            pass
        terminal = self._terminal
        if terminal is None:
            raise EdgeqError(f"job {self.job_id}: the stream was closed before it ended")
        if isinstance(terminal, ErrorEvent):
            raise JobFailed(self.job_id, terminal.code, terminal.message)
        return ChatResult(
            job_id=self.job_id,
            text="".join(self._text),
            finish_reason=terminal.finish_reason,
            usage=terminal.usage,
            timings=terminal.timings,
            reasoning=terminal.reasoning,
        )

    async def aclose(self) -> None:
        """Stop listening (the job itself goes on); safe to call more than once."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (redis.exceptions.RedisError, OSError):
                pass  # the connection is being dropped anyway

    async def _next_event(self, pubsub: PubSub) -> DeltaEvent | DoneEvent | ErrorEvent:
        deadline = time.monotonic() + self._stream_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            with redis_errors(self._redis_url):
                message = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=remaining
                )
            if message is None or message["type"] != "message":
                continue
            try:
                event = decode_event(message["data"])
            except ValidationError as error:
                raise StreamBroken(f"job {self.job_id}: undecodable event: {error}") from None
            if event.job_id != self.job_id:
                raise StreamBroken(f"job {self.job_id}: got an event of job {event.job_id}")
            if event.seq != self._next_seq:
                raise StreamBroken(
                    f"job {self.job_id}: expected event seq {self._next_seq}, got {event.seq}"
                )
            self._next_seq += 1
            return event
        raise JobTimeout(
            self.job_id,
            self._stream_timeout_s,
            "is a worker running and serving this queue? (EDGEQ_STREAM_TIMEOUT_S sets the wait)",
        )


class ChatClient:
    """Submits chat jobs to edgeq's queue. One pooled Redis connection set per client."""

    def __init__(self, settings: ConnectionSettings | None = None, **overrides: Any) -> None:
        if settings is None:
            settings = load_settings(ConnectionSettings, **overrides)
        elif overrides:
            settings = settings.model_copy(update=overrides)
        self.settings = settings
        self._redis = make_redis(settings)

    @classmethod
    def from_url(cls, redis_url: str, **overrides: Any) -> ChatClient:
        return cls(redis_url=redis_url, **overrides)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def submit(self, messages: MessagesLike, **fields: Any) -> ChatJob:
        """Validate, subscribe to the job's channel, wait for Redis to confirm, then enqueue."""
        request = build_request(messages, **fields)
        job_id = uuid.uuid4().hex
        url = self.settings.redis_url
        pubsub = self._redis.pubsub()
        try:
            with redis_errors(url):
                await pubsub.subscribe(stream_channel(job_id))
                await self._wait_for_subscription(pubsub)
                await self._redis.enqueue_job(
                    JOB_FUNCTION, request.model_dump(mode="json", exclude_none=True), _job_id=job_id
                )
        except BaseException:
            await pubsub.aclose()
            raise
        return ChatJob(
            job_id, pubsub, stream_timeout_s=self.settings.stream_timeout_s, redis_url=url
        )

    async def chat(self, messages: MessagesLike, **fields: Any) -> ChatResult:
        """Submit and wait for the whole answer."""
        job = await self.submit(messages, **fields)
        return await job.result()

    async def _wait_for_subscription(self, pubsub: PubSub) -> None:
        deadline = time.monotonic() + self.settings.redis_socket_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            message = await pubsub.get_message(timeout=remaining)
            if message is not None and message["type"] == "subscribe":
                return
        raise RedisUnavailable(
            f"Redis at {redacted_url(self.settings.redis_url)} did not confirm the subscription "
            f"within {self.settings.redis_socket_timeout_s:g} s"
        )
