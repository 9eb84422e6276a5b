"""Calls of one Lua script from many coroutines, sent to Redis together.

Calls that arrive while a round trip is in flight go out together in the next batch: one
round trip (and one socket write) per event-loop turn instead of one per call. That is what
lets one worker stream hundreds of chats, and one client submit a burst of them, without a
connection or a syscall per caller. Each caller still awaits its own reply, in its own order.

A batch is one script call: the script is wrapped in a Lua function that runs once per call of
the batch, each over its own slice of KEYS and ARGV (``combined``), so Redis parses, looks up
and starts one script per batch instead of one per call, and the worker packs one command and
reads one reply. A call that raises gets its own error, and the other calls of its batch run,
as they would have as separate scripts. Redis runs a batch whole, with no other client's
command in between; no caller relies on one coming between its call and another's. The calls'
keys must be in one Redis Cluster slot, as every edgeq script's are (a queue's keys and its
jobs' share the queue's hash tag: core/keys.py).

The command is packed by hiredis (C; redis-py's own packing was ~9 % of the worker's event-loop
samples under a burst of 50 chats, and one 12-field EVALSHA took 11-13 µs to pack against
~1.4 µs with hiredis: py-spy and timeit on a 2-vCPU machine, 2026-12-02/03) and sent with
EVALSHA; a script Redis does not have (after a restart) is loaded once and the batch sent
again.

A call can be held back until something else has happened (``after``): a client's enqueue
waits for its SUBSCRIBE to be written, without a loop turn of its own in between
(producer/client.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from edgeq.core.scripts import lua_file

Call = tuple[Sequence[str], Sequence[bytes | str | int]]  # keys, args
# A call waiting for its batch: the call, its caller's future, what it must wait for.
_Queued = tuple[Call, "asyncio.Future[Any]", "asyncio.Future[Any] | None"]


# A batched script's body becomes the function ``call`` that lua/batched.lua runs once per
# call: these two lines around it are all the Lua written here (a .lua file cannot hold half a
# function, and Redis has no other way to run one script's text inside another).
_CALL_HEAD = "local batch = {}\nlocal function call(KEYS, ARGV)\n"
_CALL_TAIL = "\nend\n"


def combined(source: str) -> str:
    """``source`` run once per call of a batch, over that call's KEYS and ARGV. ARGV begins
    with the calls' shapes: how many calls, then each one's key count and argument count. A
    call that raises replies with its error and the next call runs, as separate scripts
    would; a call that returns nothing replies nil (false), so the replies keep their places.
    ``source`` may keep what the calls of one batch share in the table ``batch``."""
    return _CALL_HEAD + source + _CALL_TAIL + lua_file("batched")


class BatchedScript:
    def __init__(self, redis: Redis, source: str) -> None:
        self._redis = redis
        self._source = combined(source)
        self._sha = hashlib.sha1(self._source.encode()).hexdigest()
        self._queued: list[_Queued] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(
        self,
        keys: Sequence[str],
        args: Sequence[bytes | str | int],
        *,
        after: asyncio.Future[Any] | None = None,
    ) -> Any:
        return (await self.call_many([(keys, args)], after=after))[0]

    async def call_many(
        self, calls: Sequence[Call], *, after: asyncio.Future[Any] | None = None
    ) -> list[Any]:
        """Several calls, in order, in the same batch; their replies in the same order.

        ``after``: a future the calls must not reach Redis before (they go in the first batch
        after it is done); if it fails, they are not sent and fail with its error."""
        loop = asyncio.get_running_loop()
        futures = []
        for call in calls:
            future: asyncio.Future[Any] = loop.create_future()
            self._queue((call, future, after))
            futures.append(future)
        if len(futures) == 1:  # most calls: no gather's own future and callbacks per call
            return [await futures[0]]
        return list(await asyncio.gather(*futures))

    async def _flush(self) -> None:
        while self._queued:
            queued, self._queued = self._queued, []
            batch = self._ready(queued)
            if not batch:
                continue
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

    def _ready(self, queued: list[_Queued]) -> list[tuple[Call, asyncio.Future[Any]]]:
        """The queued calls that may go now. One whose ``after`` is not done yet comes back
        to the queue when it is (the rest do not wait for it); one whose ``after`` failed
        fails with its error, unsent."""
        ready = []
        for queued_call in queued:
            call, future, after = queued_call
            if after is None:
                ready.append((call, future))
            elif not after.done():
                after.add_done_callback(lambda _, held=queued_call: self._queue(held))
            elif after.cancelled():
                future.cancel()
            elif (error := after.exception()) is not None:
                if not future.done():  # else its caller stopped waiting
                    future.set_exception(error)
            elif not future.done():
                ready.append((call, future))
        return ready

    def _queue(self, queued_call: _Queued) -> None:
        self._queued.append(queued_call)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    async def _execute(self, calls: Sequence[Call]) -> list[Any]:
        try:
            return await self._send(calls)
        except NoScriptError:  # Redis restarted (or its scripts were flushed): nothing ran
            await self._redis.script_load(self._source)
            return await self._send(calls)

    async def _send(self, calls: Sequence[Call]) -> list[Any]:
        keys = [key for call_keys, _ in calls for key in call_keys]
        shapes = [count for call_keys, args in calls for count in (len(call_keys), len(args))]
        args = [arg for _, call_args in calls for arg in call_args]
        command = ("EVALSHA", self._sha, len(keys), *keys, len(calls), *shapes, *args)
        packed = pack_command(command)
        pool = self._redis.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(packed)
            # A call's own error (there is none in edgeq's scripts) arrives inside the list.
            return list(await connection.read_response())
        except ResponseError:
            raise  # the reply was read: the connection is clean
        except BaseException:
            # A reply left unread would be read by the connection's next user as its own.
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)
