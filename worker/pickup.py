"""Fast job pickup for arq: a wake-up instead of blind polling, and no per-poll cost that grows
with the jobs already running.

arq finds jobs by polling its queue every ``poll_delay`` (500 ms by default: ~250 ms added to
every chat) and, on every poll, re-checks each job it already runs with ~4 Redis round trips,
because running jobs stay in the queue (see ../shared/notes/arq-redis.md). Here:

- producers PUBLISH on ``{queue}:wake`` after each enqueue (producer/queue.py); an idle worker
  waits on that channel, so a job starts within a Redis round trip of its enqueue, and an idle
  worker still looks once per ``IDLE_WAIT_S`` in case a producer did not signal;
- while jobs run, the worker polls every ``poll_delay`` (slots free up, aborts arrive);
- ``start_jobs`` drops ids this worker already runs and, in one round trip, ids another
  worker holds, before arq's per-job WATCH/MULTI.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.exceptions
from arq.connections import log_redis_info
from arq.worker import Worker

from producer.protocol import in_progress_key
from producer.queue import wake_channel

# An idle worker also looks at the queue this often, for producers that do not signal.
IDLE_WAIT_S = 1.0
# After a Redis error while waiting, pause this long before trying again.
WAIT_RETRY_S = 0.5

arq_logger = logging.getLogger("arq.worker")
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class FastPickupWorker(Worker):
    """arq's Worker with a wake-up channel and a constant-cost poll (see the module doc)."""

    _wake: Any = None
    #: False gives arq's own polling back (EDGEQ_FAST_PICKUP=false): for comparisons, and as
    #: a way out should a future arq change the internals overridden here.
    fast_pickup = True

    async def main(self) -> None:
        # arq's main() with its sleep replaced by _wait_for_work(); burst mode is not used here.
        if not self.fast_pickup:
            return await super().main()
        if self.burst:
            raise ValueError("edgeq's worker does not run in burst mode")
        arq_logger.info(
            "Starting worker for %d functions: %s", len(self.functions), ", ".join(self.functions)
        )
        await log_redis_info(self.pool, arq_logger.info)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        while True:
            await self._poll_iteration()
            await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        busy = bool(self.tasks) or not self.allow_pick_jobs
        wait_s = self.poll_delay_s if busy else IDLE_WAIT_S
        try:
            if self._wake is None:
                self._wake = self.pool.pubsub(ignore_subscribe_messages=True)
                await self._wake.subscribe(wake_channel(self.queue_name))
            await self._wake.get_message(timeout=wait_s)
        except _REDIS_ERRORS:
            wake, self._wake = self._wake, None
            if wake is not None:
                await wake.aclose()
            await asyncio.sleep(WAIT_RETRY_S)

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        if not self.fast_pickup:
            return await super().start_jobs(job_ids)
        candidates = [job_id for job_id in job_ids if job_id.decode() not in self.tasks]
        if not candidates:
            return
        async with self.pool.pipeline(transaction=False) as pipe:
            for job_id in candidates:
                pipe.exists(in_progress_key(job_id.decode()))
            taken = await pipe.execute()
        free = [job_id for job_id, held in zip(candidates, taken, strict=True) if not held]
        if free:
            await super().start_jobs(free)

    async def close(self) -> None:
        if self._wake is not None:
            try:
                await self._wake.aclose()
            except _REDIS_ERRORS:
                pass
        await super().close()
