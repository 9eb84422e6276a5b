"""One pub/sub connection for every stream a client follows.

A client with a thousand jobs in flight holds one pub/sub connection, not a thousand: each
job's channel is subscribed on it, and one reader task routes every message to the queue of
the job whose channel it came on.

``subscribe`` sends SUBSCRIBE and returns; it does not wait for Redis's confirmation. Nothing
is lost by that: every event carries a gap-free ``seq`` and stays in the job's replay stream.
When Redis's confirmation of a channel arrives, the reader puts ``REPLAY`` on that job's
queue: from then on every event reaches the connection live, so one read of the replay stream
at that moment catches whatever was published before (``ChatJob``); a gap seen later is
filled the same way. After a dropped connection redis-py subscribes again to every channel
(and each confirmation brings a ``REPLAY``); the reader also puts one on every queue itself.

Only the reader task reads the connection. redis-py breaks that rule once: a SUBSCRIBE sent
while the connection is subscribed to nothing first checks the connection's health, a PING
whose answer it reads itself, if the health-check interval has passed since the last read.
With the reader waiting on the same socket, that read fails ("read() called while another
coroutine is already waiting"), and so did the submit, after an event loop blocked longer
than the interval between two streams. The connection therefore stays subscribed to one
channel nobody publishes on (``SUBSCRIPTIONS_ANCHOR_CHANNEL``), from its first SUBSCRIBE on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.keys import SUBSCRIPTIONS_ANCHOR_CHANNEL, stream_channel
from edgeq.core.tasks import cancel_and_wait

#: Put on a job's queue when its subscription took effect, or came back after an outage:
#: events published before may have been missed, the replay stream has them. (An event is
#: never empty.)
REPLAY: Final = b""

ANCHOR_CHANNEL: Final = SUBSCRIPTIONS_ANCHOR_CHANNEL.encode()


class StreamSubscriptions:
    """The job channels of one client on one pub/sub connection (see the module doc)."""

    def __init__(self, redis: Redis, *, read_timeout_s: float, reconnect_delay_s: float) -> None:
        self._redis = redis
        self._read_timeout_s = read_timeout_s
        self._reconnect_delay_s = reconnect_delay_s
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        # Per channel, the queue of each reader: one client may follow one job twice (a stream
        # and an attach of it), and each reader gets every message.
        self._queues: dict[bytes, list[asyncio.Queue[bytes]]] = {}
        # One writer at a time: redis-py's PubSub takes a pool connection on its first command
        # and (re)connects on later ones without a lock of its own, so concurrent subscribes
        # would each take a connection (or connect twice) and leak all but one.
        self._writing = asyncio.Lock()
        # Channels asked for while a SUBSCRIBE is being written go out in the next one: a
        # burst of submits costs one write, not one per job.
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._subscriber: asyncio.Task[None] | None = None

    async def subscribe(self, job_id: str) -> asyncio.Queue[bytes]:
        """A queue that receives the raw events published on the job's channel, and
        ``REPLAY`` when the subscription takes effect. Raises redis-py's error if Redis is
        unreachable."""
        queue, sent = self.subscribe_soon(job_id)
        try:
            await sent
        except BaseException:
            self._forget(stream_channel(job_id).encode(), queue)
            raise
        return queue

    def subscribe_soon(self, job_id: str) -> tuple[asyncio.Queue[bytes], asyncio.Future[None]]:
        """``subscribe`` without waiting: the queue, and a future done once the SUBSCRIBE is
        written (redis-py's error if it could not be). The write runs in the next loop turn,
        with the other subscribes of this one; a caller that fails the future's wait should
        ``unsubscribe`` the queue."""
        channel = stream_channel(job_id).encode()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        # SUBSCRIBE goes out even if the channel is already subscribed: its confirmation is
        # this reader's REPLAY (the others get one too, which costs them one read).
        self._queues.setdefault(channel, []).append(queue)
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((channel, sent))
        if self._subscriber is None or self._subscriber.done():
            self._subscriber = asyncio.create_task(self._send_subscribes())
        return queue, sent

    async def _send_subscribes(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            channels = [channel for channel, _ in batch]
            try:
                async with self._writing:
                    pubsub = self._connected()
                    if not pubsub.subscribed:  # the first SUBSCRIBE, or one that failed
                        channels.append(ANCHOR_CHANNEL)
                    await pubsub.subscribe(*channels)
            except BaseException as error:  # each waiting submit learns what happened
                for _, sent in batch:
                    if not sent.done():
                        sent.set_exception(error)
                if not isinstance(error, Exception):
                    raise
                continue
            self._start_reader()
            for _, sent in batch:
                if not sent.done():
                    sent.set_result(None)

    async def unsubscribe(self, job_id: str, queue: asyncio.Queue[bytes]) -> None:
        """Stop routing the job's channel to this reader; UNSUBSCRIBE is sent (not awaited past
        the write) when it was the channel's last."""
        channel = stream_channel(job_id).encode()
        if not self._forget(channel, queue) or channel in self._queues:
            return
        unsent = [sent for pending, sent in self._pending if pending == channel]
        if unsent:
            # Its SUBSCRIBE was not written yet (a submit cancelled at once): it never will be,
            # rather than go out after an UNSUBSCRIBE and leave the channel subscribed.
            for sent in unsent:
                sent.cancel()
            self._pending = [(other, sent) for other, sent in self._pending if other != channel]
            return
        async with self._writing:
            if channel in self._queues:  # a new reader came while we waited: keep the channel
                return
            pubsub = self._pubsub  # None once the client is closed: nothing to unsubscribe
            if pubsub is not None:
                with contextlib.suppress(*REDIS_ERRORS):  # a dropped connection has no channel
                    await pubsub.unsubscribe(channel)

    async def aclose(self) -> None:
        await cancel_and_wait(*(task for task in (self._reader, self._subscriber) if task))
        self._reader = self._subscriber = None
        pending, self._pending = self._pending, []
        for _, sent in pending:  # submits still waiting for their SUBSCRIBE: it never went out
            sent.cancel()
        pubsub, self._pubsub = self._pubsub, None
        self._queues.clear()
        if pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await pubsub.aclose()

    def _forget(self, channel: bytes, queue: asyncio.Queue[bytes]) -> bool:
        """Drop one reader of a channel (and the channel with its last); False if unknown."""
        readers = self._queues.get(channel, [])
        if queue not in readers:
            return False
        readers.remove(queue)
        if not readers:
            del self._queues[channel]
        return True

    def _connected(self) -> PubSub:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub()  # with the confirmations: see the module doc
        return self._pubsub

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="edgeq-stream-reader")

    async def _read(self) -> None:
        pubsub = self._connected()
        missed = False
        while True:
            try:
                message = await pubsub.get_message(timeout=self._read_timeout_s)
            except REDIS_ERRORS:
                missed = True  # redis-py reconnects (and subscribes again) on the next read
                await asyncio.sleep(self._reconnect_delay_s)
                continue
            if missed:
                missed = False
                for readers in self._queues.values():
                    for queue in readers:
                        queue.put_nowait(REPLAY)
            if message is None or message["type"] not in ("message", "subscribe"):
                continue
            # No reader: a late message of a stream already closed.
            item = message["data"] if message["type"] == "message" else REPLAY
            for queue in self._queues.get(message["channel"], ()):
                queue.put_nowait(item)
