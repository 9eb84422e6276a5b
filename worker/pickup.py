"""Fast job pickup for arq: a wake-up instead of blind polling, and one round trip to take a
whole burst.

arq finds jobs by polling its queue every ``poll_delay`` (500 ms by default: ~250 ms added to
every chat) and takes them one at a time: per job a WATCH/EXISTS/ZSCORE/MULTI transaction of
~4 Redis round trips, then one more in ``run_job``. A burst of 64 chats then reaches the
engine over 320 round trips, each one queued behind the streaming of the chats already
running; and with several workers on one queue all of them walk the same ids in the same
order, so the slower one loses every race and sits idle while jobs wait. Here:

- producers PUBLISH on ``{queue}:wake`` after each enqueue (producer/queue.py), and so does a
  hand-over of a lost worker's job (core/leases.py); a task of the worker listens on that
  channel, and a wake, or one of its own jobs ending (a slot came free), starts a claim at
  once: a job starts within a Redis round trip of its enqueue, busy or idle;
- without a signal the worker still looks every ``poll_delay`` while jobs run (arq's
  ``Job.abort``, which signals nothing) and every ``IDLE_WAIT_S`` when idle (a producer that
  did not signal). A busy worker used to poll every 10 ms for all of these: ~200 round trips a
  second while anything ran, about a quarter of its CPU streaming one chat
  (docs/benchmarks-history.md);
- each poll is one Lua script (``claim_due_jobs``) that reads the queue's head and takes as
  many due jobs as the worker has free slots, setting arq's own in-progress key as arq would:
  whichever worker runs it first takes what it can hold, the next one takes the rest, and no
  job is taken twice. The same step writes each job's lease (on Redis's clock,
  core/leases.py), so a job is never taken without one: a worker that dies, or loses Redis,
  right after its claim still leaves jobs that anyone can hand over; and it keeps the job's
  payload for as long as the job may run (its queue deadline no longer applies once it
  started), so a worker continuing the job after a crash still finds the request;
- the same step also does what arq's ``run_job`` would do in a round trip of its own before
  each job (read the payload, count the start, take a pending abort), so a burst of 50 jobs
  reaches the engine after one round trip instead of 51 (``run_claimed``);
- arq's abort set is a worker attribute (``abort_set``): ``arq:abort`` is one key for every
  queue, in a slot of its own, so on a Redis Cluster each queue has its own
  (``{queue}:abort``, core/keys.py) and arq's finish steps, which take a job out of the
  abort set in the same transaction as its other keys, are redone here with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from arq.connections import log_redis_info
from arq.constants import (
    abort_job_max_age,
    abort_jobs_ss,
    in_progress_key_prefix,
    job_key_prefix,
    result_key_prefix,
    retry_key_prefix,
)
from arq.jobs import SerializationError, deserialize_job_raw, serialize_result
from arq.utils import ms_to_datetime, timestamp_ms, to_ms
from arq.worker import JobExecutionFailed, Worker

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.keys import (
    retry_key,
    wake_channel,
)
from edgeq.core.tasks import cancel_and_wait
from edgeq.worker.claim import START_COUNT_TTL_S, ClaimedJob, claim_due_jobs

# An idle worker also looks at the queue this often, for producers that do not signal.
IDLE_WAIT_S = 1.0
# After a Redis error while waiting, pause this long before trying again.
WAIT_RETRY_S = 0.5

arq_logger = logging.getLogger("arq.worker")


class FastPickupWorker(Worker):
    """arq's Worker with a wake-up channel, one round trip per claim, and claimed jobs started
    without a round trip of their own (see the module doc)."""

    #: Set by a wake message and by a job's end; the main loop claims when it is set.
    _work_signal: asyncio.Event | None = None
    _wake_listener: asyncio.Task[None] | None = None
    #: When running jobs are next checked for arq's aborts (time.monotonic()).
    _next_abort_check = 0.0

    #: How long the lease written at claim lasts (EDGEQ_LEASE_TTL_S), in ms.
    lease_ttl_ms = 10_000
    #: Free slots batch jobs never take (EDGEQ_RESERVED_SLOTS): a batch job is claimed only
    #: into the free slots beyond these, so a chat arriving while batch work fills the box
    #: starts at once.
    reserved_slots = 0
    #: False gives arq's own polling back (EDGEQ_FAST_PICKUP=false): for comparisons, and as
    #: a way out should a future arq change the internals overridden here.
    fast_pickup = True
    #: Where arq's aborts wait: arq's own set, or the queue's on a Redis Cluster.
    abort_set = abort_jobs_ss

    async def main(self) -> None:
        # arq's main() with its sleep replaced by _wait_for_work(); burst mode is not used here.
        if not self.fast_pickup:
            return await super().main()
        if self.burst:
            raise ValueError("edgeq's worker does not run in burst mode")
        if self.retry_jobs:
            raise ValueError("edgeq's fast pickup runs jobs without arq's Retry")
        arq_logger.info(
            "Starting worker for %d functions: %s", len(self.functions), ", ".join(self.functions)
        )
        await log_redis_info(self.pool, arq_logger.info)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        signal = self._work_signal = asyncio.Event()
        listener = self._wake_listener = asyncio.create_task(self._listen_for_wakes(signal))
        while True:
            if listener.done():  # not a Redis outage (it rides those out): as arq, stop
                listener.result()
            # Cleared before the claim: a signal during its round trip claims again at once.
            signal.clear()
            await self._poll_iteration()
            await self._wait_for_work(signal)

    async def _wait_for_work(self, signal: asyncio.Event) -> None:
        busy = bool(self.tasks) or not self.allow_pick_jobs
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.poll_delay_s if busy else IDLE_WAIT_S):
                await signal.wait()

    async def _listen_for_wakes(self, signal: asyncio.Event) -> None:
        """Set ``signal`` for every message on the queue's wake channel, for good: a Redis
        error closes the subscription, and it is made again after WAIT_RETRY_S."""
        while True:
            wakes = self.pool.pubsub(ignore_subscribe_messages=True)
            try:
                await wakes.subscribe(wake_channel(self.queue_name))
                signal.set()  # a wake sent while not subscribed was missed: look now
                while True:
                    if await wakes.get_message(timeout=IDLE_WAIT_S) is not None:
                        signal.set()
            except REDIS_ERRORS:
                await asyncio.sleep(WAIT_RETRY_S)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await asyncio.shield(wakes.aclose())

    def _job_ended(self) -> None:
        self._release_sem_dec_counter_on_complete()
        if self._work_signal is not None:
            self._work_signal.set()  # a slot came free: take what waits for it

    async def _poll_iteration(self) -> None:
        # arq's _poll_iteration with its read of the queue's head and start_jobs folded into
        # one claim.
        if not self.fast_pickup:
            return await super()._poll_iteration()
        if self.allow_pick_jobs and self.job_counter < self.max_jobs:
            await self.claim_and_start()
        # Aborts as often as arq looks for them (every poll_delay), not on every wake and job
        # end: that round trip stood between a wake that came during it and the next claim.
        if self.allow_abort_jobs and time.monotonic() >= self._next_abort_check:
            self._next_abort_check = time.monotonic() + self.poll_delay_s
            await self._cancel_aborted_jobs()
        for job_id, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[job_id]
                task.result()  # an error in run_claimed surfaces here, as in arq
        await self.heart_beat()

    async def claim_and_start(self) -> None:
        free_slots = self.max_jobs - self.job_counter
        now_ms = timestamp_ms()
        claimed = await claim_due_jobs(
            self.pool,
            self.queue_name,
            wanted=free_slots,
            wanted_batch=max(0, free_slots - self.reserved_slots),
            scan_limit=self.queue_read_limit,
            ttl_ms=int(self.in_progress_timeout_s * 1000),
            lease_ttl_ms=self.lease_ttl_ms,
            now_ms=now_ms,
            abort_set=self.abort_set,
        )
        for job in claimed:
            # What arq's start_jobs does with a job it took. job_counter < max_jobs, so the
            # semaphore (max_jobs + 1 permits) has a permit free and this does not wait.
            await self.sem.acquire()
            self.job_counter += 1
            # arq takes the score for the enqueue time (it logs "delayed" from it); edgeq's
            # scores are fair-queuing tags, so the job gets the claim's time instead.
            task = self.loop.create_task(self.run_claimed(job, now_ms))
            task.add_done_callback(lambda _: self._job_ended())
            self.tasks[job.job_id] = task

    async def run_claimed(self, job: ClaimedJob, claimed_ms: int) -> None:
        """arq's ``run_job`` for a job whose payload, start count and abort the claim already
        read: the same outcomes (expired, aborted before start, too many starts, failed, done)
        and the same records, without arq's round trip per job. arq's cron jobs, ``Retry`` and
        text log lines are left out: edgeq uses none of them (its jobs log their own events)."""
        job_id, job_try = job.job_id, job.job_try
        function_name, enqueue_time_ms = "<unknown>", 0
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        start_ms = timestamp_ms()

        def outcome(success: bool, result: Any, finished_ms: int) -> bytes | None:
            return serialize_result(
                function_name, args, kwargs, job_try, enqueue_time_ms, success, result,
                start_ms, finished_ms, f"{job_id}:{function_name}", self.queue_name,
                job_id=job_id, serializer=self.job_serializer,
            )  # fmt: skip

        async def failed_before_start(error: BaseException) -> None:
            self.jobs_failed += 1
            result_data = outcome(False, error, timestamp_ms())
            await asyncio.shield(self.finish_failed_job(job_id, result_data))

        if job.payload is None:
            return await failed_before_start(JobExecutionFailed("job expired"))
        try:
            function_name, args, kwargs, enqueued_try, enqueue_time_ms = deserialize_job_raw(
                job.payload, deserializer=self.job_deserializer
            )
        except SerializationError as error:
            return await failed_before_start(error)
        if job.aborted:
            return await failed_before_start(asyncio.CancelledError())
        function = self.functions.get(function_name)
        if function is None:
            return await failed_before_start(
                JobExecutionFailed(f"function {function_name!r} not found")
            )
        if enqueued_try and enqueued_try > job_try:
            job_try = enqueued_try
            await self.pool.setex(retry_key(job_id), START_COUNT_TTL_S, str(job_try))
        max_tries = self.max_tries if function.max_tries is None else function.max_tries
        if job_try > max_tries:
            return await failed_before_start(
                JobExecutionFailed(f"max {max_tries} retries exceeded")
            )

        ctx = {
            **self.ctx,
            "job_id": job_id,
            "job_try": job_try,
            "enqueue_time": ms_to_datetime(enqueue_time_ms),
            "score": claimed_ms,
        }
        if self.on_job_start:
            await self.on_job_start(ctx)
        timeout_s = self.job_timeout_s if function.timeout_s is None else function.timeout_s
        start_ms = timestamp_ms()
        # The job runs in this task, not in one of its own as in arq: a task created here
        # would run only after the run_claimed of every other job of the claim, so each job
        # of a burst would reach the engine after the whole burst's bookkeeping. An abort
        # (job_tasks) and a shutdown (tasks) both cancel this task, as they cancelled arq's two.
        self.job_tasks[job_id] = asyncio.current_task()  # type: ignore[assignment]
        try:
            async with asyncio.timeout(timeout_s):
                result = await function.coroutine(ctx, *args, **kwargs)
        except (Exception, asyncio.CancelledError) as error:
            # As arq with retry_jobs=False: an abort, a timeout, a failure or the worker's
            # shutdown all finish the job with the error as its result.
            if job_id in self.aborting_tasks and isinstance(error, asyncio.CancelledError):
                self.aborting_tasks.remove(job_id)
            else:
                arq_logger.exception("job %s failed, %s: %s", job_id, type(error).__name__, error)
            success, result = False, error
            self.jobs_failed += 1
        else:
            success = True
            self.jobs_complete += 1
        finally:
            del self.job_tasks[job_id]
        finished_ms = timestamp_ms()
        keep_forever = (
            self.keep_result_forever
            if function.keep_result_forever is None
            else function.keep_result_forever
        )
        keep_s = self.keep_result_s if function.keep_result_s is None else function.keep_result_s
        result_data = outcome(success, result, finished_ms) if keep_forever or keep_s > 0 else None
        if self.on_job_end:
            await self.on_job_end(ctx)
        await asyncio.shield(
            self.finish_job(job_id, True, result_data, keep_s, keep_forever, None, None)
        )

    async def finish_job(
        self,
        job_id: str,
        finish: bool,
        result_data: bytes | None,
        result_timeout_s: float | None,
        keep_result_forever: bool,
        incr_score: int | None,
        keep_in_progress: float | None,
    ) -> None:
        # arq's finish_job, with the abort set this worker uses.
        async with self.pool.pipeline(transaction=True) as tr:
            delete_keys = []
            in_progress_key = in_progress_key_prefix + job_id
            if keep_in_progress is None:
                delete_keys.append(in_progress_key)
            else:
                tr.pexpire(in_progress_key, to_ms(keep_in_progress))
            if finish:
                if result_data:
                    expire = None if keep_result_forever else result_timeout_s
                    tr.set(result_key_prefix + job_id, result_data, px=to_ms(expire))
                delete_keys += [retry_key_prefix + job_id, job_key_prefix + job_id]
                tr.zrem(self.abort_set, job_id)
                tr.zrem(self.queue_name, job_id)
            elif incr_score:
                tr.zincrby(self.queue_name, incr_score, job_id)
            if delete_keys:
                tr.delete(*delete_keys)
            await tr.execute()

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        # arq's finish_failed_job, with the abort set this worker uses.
        async with self.pool.pipeline(transaction=True) as tr:
            tr.delete(
                retry_key_prefix + job_id, in_progress_key_prefix + job_id, job_key_prefix + job_id
            )
            tr.zrem(self.abort_set, job_id)
            tr.zrem(self.queue_name, job_id)
            keep_result = self.keep_result_forever or self.keep_result_s > 0
            if result_data is not None and keep_result:
                expire = 0 if self.keep_result_forever else self.keep_result_s
                tr.set(result_key_prefix + job_id, result_data, px=to_ms(expire))
            await tr.execute()

    async def _cancel_aborted_jobs(self) -> None:
        # arq's, with the abort set this worker uses.
        async with self.pool.pipeline(transaction=True) as pipe:
            pipe.zrange(self.abort_set, start=0, end=-1)
            pipe.zremrangebyscore(
                self.abort_set, min=timestamp_ms() + abort_job_max_age, max=float("inf")
            )
            abort_job_ids, _ = await pipe.execute()
        aborted: set[str] = set()
        for job_id_bytes in abort_job_ids:
            job_id = job_id_bytes.decode()
            try:
                task = self.job_tasks[job_id]
            except KeyError:
                pass
            else:
                aborted.add(job_id)
                task.cancel()
        if aborted:
            self.aborting_tasks.update(aborted)
            await self.pool.zrem(self.abort_set, *aborted)

    async def close(self) -> None:
        if self._wake_listener is not None:
            await cancel_and_wait(self._wake_listener)
        await super().close()
