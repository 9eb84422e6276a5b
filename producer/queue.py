"""Putting jobs into arq's queue and taking them out again, atomically.

The enqueue is one Lua script instead of arq's WATCH/MULTI, because the depth check and the
enqueue must be one step: a burst of producers can never push the queue past its limit.
The job is stored exactly as arq expects it (README, "Wire contract").
"""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Any

from redis.asyncio import Redis

from edgeq.core.batching import BatchedScript
from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import job_key, wake_channel
from edgeq.core.protocol import JOB_FUNCTION, ErrorEvent, dump_json

_ENQUEUE = """
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[5])
redis.call('PUBLISH', ARGV[6], '')
return 1
"""


class Enqueued(IntEnum):
    ACCEPTED = 1
    QUEUE_FULL = 0
    DUPLICATE_ID = -1


class JobQueue:
    def __init__(self, redis: Redis, queue: str) -> None:
        self.name = queue
        self._redis = redis
        # Submits from many coroutines share one pipeline per loop turn (core/batching.py).
        self._enqueue = BatchedScript(redis, _ENQUEUE)

    async def enqueue(
        self, job_id: str, request: dict[str, Any], *, deadline_s: float, max_depth: int
    ) -> Enqueued:
        """Add a chat job unless the queue already holds ``max_depth`` jobs (0: no limit).

        The job's payload expires after ``deadline_s``: a worker reaching it later finds it
        gone and ends it with ``expired`` instead of starting it late.
        """
        now_ms = time.time() * 1000
        # `et` to the microsecond, so queued_ms can show sub-millisecond pickup.
        job = {"f": JOB_FUNCTION, "a": [request], "k": {}, "t": 1, "et": round(now_ms, 3)}
        outcome = await self._enqueue(
            [self.name, job_key(job_id)],
            [
                dump_json(job),
                int(now_ms),
                int(deadline_s * 1000),
                max_depth,
                job_id,
                wake_channel(self.name),
            ],
        )
        return Enqueued(int(outcome))

    async def depth(self) -> int:
        """Jobs accepted and not finished (arq keeps running jobs in the queue too)."""
        return int(await self._redis.zcard(self.name))

    async def cancel(self, log: EventLog, job_id: str, reason: str) -> bool:
        """End a job with ``cancelled``. A queued job never starts; a running one stops at
        its next event (its worker finds the stream closed and aborts the engine request).
        False if the job had already ended.

        The job leaves the queue before its stream ends, so whoever sees ``cancelled`` finds
        its place in the queue free (a job that had ended is gone from the queue anyway)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.name, job_id)
            pipe.delete(job_key(job_id))
            await pipe.execute()
        try:
            await log.append(ErrorEvent(job_id=job_id, seq=0, code="cancelled", message=reason))
        except StreamClosed:
            return False
        return True
