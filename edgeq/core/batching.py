"""Calls of one Lua script from many coroutines, sent to Redis together.

Calls that arrive while a round trip is in flight go out together in the next pipeline: one
round trip (and one socket write) per event-loop turn instead of one per call. That is what
lets one worker stream hundreds of chats, and one client submit a burst of them, without a
connection or a syscall per caller. Each caller still awaits its own reply, in its own order.

A batch goes out as EVALSHA commands packed by hiredis, written once on one pooled connection,
and its replies read back in order: what redis-py's pipeline does, without its pure-Python
packing, which cost about a tenth of the worker's event loop under the seed's burst
(docs/benchmarks.md, "Where the worker's time goes"); hiredis packs the same bytes ~7x faster.
EVALSHA rather than redis-py's Script objects: a pipeline holding those first asks SCRIPT
EXISTS on every execute, a second round trip per batch. A script Redis does not have (after
a restart) is loaded once and its calls sent again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

Call = tuple[Sequence[str], Sequence[bytes | str | int]]  # keys, args


class BatchedScript:
    def __init__(self, redis: Redis, source: str) -> None:
        self._redis = redis
        self._source = source
        self._sha = hashlib.sha1(source.encode()).hexdigest()
        self._queued: list[tuple[Call, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        return (await self.call_many([(keys, args)]))[0]

    async def call_many(self, calls: Sequence[Call]) -> list[Any]:
        """Several calls, in order, in the same pipeline; their replies in the same order."""
        loop = asyncio.get_running_loop()
        futures = []
        for call in calls:
            future: asyncio.Future[Any] = loop.create_future()
            self._queued.append((call, future))
            futures.append(future)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        if len(futures) == 1:  # most calls: no gather's own future and callbacks per call
            return [await futures[0]]
        return list(await asyncio.gather(*futures))

    async def _flush(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                replies = await self._execute([call for call, _ in batch])
            except BaseException as error:  # every waiting caller learns what happened
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                if not isinstance(error, Exception):
                    raise
                continue
            for (_, future), reply in zip(batch, replies, strict=True):
                if future.done():
                    continue
                if isinstance(reply, Exception):  # this call's own error (the others ran)
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    async def _execute(self, calls: Sequence[Call]) -> list[Any]:
        replies = await self._send(calls)
        missing = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:  # Redis restarted (or its scripts were flushed): they ran nowhere
            await self._redis.script_load(self._source)
            again = await self._send([calls[n] for n in missing])
            for n, reply in zip(missing, again, strict=True):
                replies[n] = reply
        return replies

    async def _send(self, calls: Sequence[Call]) -> list[Any]:
        packed = b"".join(
            pack_command(("EVALSHA", self._sha, len(keys), *keys, *args)) for keys, args in calls
        )
        pool = self._redis.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(packed)
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as error:  # this call's own error: the next reply follows
                    replies.append(error)
            return replies
        except BaseException:
            # Replies left unread would be read by the connection's next user as its own.
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)
