"""The blocking client, for synchronous backends (Django, Flask, scripts, worker threads).

    with SyncChatClient() as client:                   # settings from EDGEQ_* / .env
        job = client.submit("Why is the sky blue?", max_tokens=64)
        for event in job.stream():                     # DeltaEvent …, then DoneEvent
            ...
        answer = job.result()

        answer = client.chat("What is Redis?")         # or in one call

It is not a second implementation of the protocol: each client runs one ``ChatClient`` on an
event loop in a background thread (an anyio blocking portal) and every method waits for its
async twin there. So the guarantees, the settings and the exceptions are exactly the async
client's: ``InvalidRequest``, ``QueueFull``, ``JobFailed``, ``JobTimeout``,
``RedisUnavailable``, ``StreamBroken`` (``edgeq.core.errors``), ``ConfigError`` at construction.

Create one client per process and share it between threads: calls from any number of threads
run concurrently on the one loop and its one Redis connection pool. A ``SyncChatJob`` belongs to
one thread at a time, like a file. ``close()`` (or leaving the ``with`` block) ends the calls
still running in other threads with ``EdgeqError("the client is closed")``, closes the pool
and stops the thread. A client is bound to the process that created it: after a fork (for
instance gunicorn ``--preload``) create a new one in the child.

Code that runs on an event loop should use ``edgeq.ChatClient`` instead: these
methods block the calling thread for as long as the job takes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import CancelledError
from types import TracebackType
from typing import Any, TypeVar, overload

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from edgeq.core.errors import EdgeqError
from edgeq.core.protocol import ChatResult, StreamEvent
from edgeq.core.settings import ConnectionSettings
from edgeq.core.structured import ModelT
from edgeq.producer.client import ChatClient, ChatJob, MessagesLike

T = TypeVar("T")

# On close, how long calls cancelled in other threads may take to unwind before the Redis pool
# is closed under them; unwinding takes a few loop turns, this only bounds a stuck one.
SHUTDOWN_GRACE_S = 5.0

CLIENT_CLOSED = "the client is closed"


async def _next_or_none(events: AsyncIterator[StreamEvent]) -> StreamEvent | None:
    """The stream's next event, None at its end (events are never None)."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


class SyncChatJob:
    """A chat job's stream, read blocking: iterate ``stream()`` once, or just call ``result()``.

    Also a context manager: leaving the block stops listening (the job itself goes on).
    """

    def __init__(self, client: SyncChatClient, job: ChatJob) -> None:
        self.job_id = job.job_id
        self._client = client
        self._job = job

    def stream(self) -> Iterator[StreamEvent]:
        """Yield the job's events in order, ending with its terminal event (see ChatJob.stream).

        Stopping early (``break``, or closing the generator) closes the underlying stream, as
        leaving ``async for`` does; the job itself goes on and can be attached to again.
        """
        # Created here but first run on the loop, so the loop's async-generator hooks own it.
        events = self._job.stream()
        ended = False
        try:
            while (event := self._client._call(_next_or_none, events)) is not None:
                yield event
            ended = True
        finally:
            if not ended:
                self._client._call_quietly(events.aclose)

    def result(self) -> ChatResult:
        """The whole answer (from ``after_seq`` on); raises JobFailed on an error event."""
        return self._client._call(self._job.result)

    def cancel(self, reason: str = "cancelled by the client") -> bool:
        """Stop the job (see ChatClient.cancel); its stream then ends with ``cancelled``."""
        return self._client._call(self._job.cancel, reason)

    def close(self) -> None:
        """Stop listening (the job itself goes on); safe to call more than once, and after the
        client was closed (which already dropped every connection)."""
        self._client._call_quietly(self._job.aclose)

    def __enter__(self) -> SyncChatJob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class SyncChatClient:
    """Submits chat jobs to edgeq's queue, blocking. Thread-safe: share one per process."""

    def __init__(self, settings: ConnectionSettings | None = None, **overrides: Any) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        # Only touched on the portal's loop thread, so they need no lock.
        self._closing = False
        self._running: set[anyio.CancelScope] = set()
        self._all_ended: anyio.Event | None = None
        self._portal_cm: contextlib.AbstractContextManager[BlockingPortal] = start_blocking_portal(
            name=f"edgeq-sync-client-{id(self):x}"
        )
        self._portal = self._portal_cm.__enter__()
        try:
            # Built on the loop's thread, where its connections will live; a bad setting
            # raises ConfigError from here exactly as ChatClient() does.
            self._client: ChatClient = self._portal.call(
                functools.partial(ChatClient, settings, **overrides)
            )
        except BaseException:
            self._closed = True
            self._portal_cm.__exit__(None, None, None)
            raise
        self.settings: ConnectionSettings = self._client.settings

    @classmethod
    def from_url(cls, redis_url: str, **overrides: Any) -> SyncChatClient:
        return cls(redis_url=redis_url, **overrides)

    def __enter__(self) -> SyncChatClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def submit(
        self, messages: MessagesLike, *, deadline_s: float | None = None, **fields: Any
    ) -> SyncChatJob:
        """Validate, subscribe, then enqueue (see ChatClient.submit); returns once enqueued.

        Raises InvalidRequest, QueueFull or RedisUnavailable like the async client.
        """
        job = self._call(
            functools.partial(self._client.submit, messages, deadline_s=deadline_s, **fields)
        )
        return SyncChatJob(self, job)

    @overload
    def chat(self, messages: MessagesLike, *, schema: None = None, **fields: Any) -> ChatResult: ...
    @overload
    def chat(self, messages: MessagesLike, *, schema: type[ModelT], **fields: Any) -> ModelT: ...
    def chat(
        self, messages: MessagesLike, *, schema: type[ModelT] | None = None, **fields: Any
    ) -> ChatResult | ModelT:
        """Submit and wait for the whole answer; ``schema`` as in ChatClient.chat."""
        return self._call(functools.partial(self._client.chat, messages, schema=schema, **fields))

    def attach(self, job_id: str, *, after_seq: int = -1) -> SyncChatJob:
        """Follow an existing job from ``after_seq`` on, replaying what was missed (see
        ChatClient.attach); works after the job finished, for EDGEQ_REPLAY_TTL_S."""
        job = self._call(functools.partial(self._client.attach, job_id, after_seq=after_seq))
        return SyncChatJob(self, job)

    def cancel(self, job_id: str, reason: str = "cancelled by the client") -> bool:
        """End a job with ``cancelled`` (see ChatClient.cancel). False if it had already ended."""
        return self._call(self._client.cancel, job_id, reason)

    def close(self) -> None:
        """End calls still running in other threads, close the Redis pool, stop the loop's
        thread. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return  # the loop's thread exists only in the parent process
        try:
            self._portal.call(self._shutdown)
        finally:
            self._portal_cm.__exit__(None, None, None)  # stops the loop, joins its thread

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``func(*args)`` on the loop and wait for it; its exception is raised here."""
        if self._closed:
            raise EdgeqError(CLIENT_CLOSED)
        if os.getpid() != self._pid:
            # The loop's thread did not survive the fork: waiting for it would hang forever.
            raise EdgeqError(
                f"this client was created in process {self._pid} and its loop thread does not "
                f"exist after a fork; create a new SyncChatClient in process {os.getpid()}"
            )
        try:
            future = self._portal.start_task_soon(self._guarded, func, *args)
        except RuntimeError:
            if self._closed:  # closed by another thread after the check above
                raise EdgeqError(CLIENT_CLOSED) from None
            raise
        try:
            return future.result()
        except CancelledError:
            if self._closed:  # the portal went away under the call
                raise EdgeqError(CLIENT_CLOSED) from None
            raise
        except BaseException:
            if not future.done():
                # Interrupted while waiting (KeyboardInterrupt): do not leave the call running.
                future.cancel()
            raise

    def _call_quietly(self, func: Callable[[], Awaitable[object]]) -> None:
        """Best-effort cleanup, which must not mask the error being handled: once the client is
        closed there is nothing left to close, a generator may be finalized where the loop
        cannot be waited for (its own thread, a forked child), and a stream whose call was
        interrupted is still unwinding on the loop (it closes itself)."""
        with contextlib.suppress(EdgeqError, RuntimeError):
            self._call(func)

    async def _guarded(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run one call so that close() can end it with a clear error instead of hanging."""
        if self._closing:
            raise EdgeqError(CLIENT_CLOSED)
        with anyio.CancelScope() as scope:
            self._running.add(scope)
            try:
                return await func(*args)
            finally:
                self._running.discard(scope)
                if self._all_ended is not None and not self._running:
                    self._all_ended.set()
        raise EdgeqError(CLIENT_CLOSED)  # reached only when close() cancelled the scope

    async def _shutdown(self) -> None:
        self._closing = True
        if self._running:
            self._all_ended = anyio.Event()
            for scope in list(self._running):
                scope.cancel()
            with anyio.move_on_after(SHUTDOWN_GRACE_S):
                await self._all_ended.wait()
        await self._client.aclose()
