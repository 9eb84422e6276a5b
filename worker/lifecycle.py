"""A job's life in the worker, in one module:

    wake / poll ─> claim ─> start ─> stream (the job) ─> finish
                     │        ├─> fail before start: expired, aborted, started too often
                     │        └─> cancel: an abort for a running job cancels its task
                     └─> hand over: a dead worker's job is back in the queue (core/leases.py);
                         the next claim starts it again and the job continues its stream
    SIGTERM ─> drain: no more claims, running jobs get EDGEQ_DRAIN_TIMEOUT_S, then `shutdown`

- **Wake.** Producers PUBLISH on ``{queue}:wake`` after each enqueue (producer/queue.py), and
  so does a hand-over (core/leases.py). The loop listens on that channel; a wake, or one of its
  own jobs ending (a slot came free), starts a claim at once, so a job starts within a Redis
  round trip of its enqueue. Without a signal it still looks every ``poll_delay_s`` while jobs
  run (arq's ``Job.abort`` signals nothing) and every ``IDLE_WAIT_S`` when idle.
- **Claim.** One Lua script takes as many due jobs as there are free slots, with their leases,
  payloads, start counts and pending aborts (worker/claim.py): a burst of 50 reaches the
  engine after one round trip, and two workers never take the same job.
- **Start.** Each claimed job runs in a task of its own: the payload is decoded (arq's format,
  worker/arq_seam.py), then the job function runs. A job that cannot start gets its one error
  event here (worker/outcomes.py, ``NotStarted``).
- **Finish.** The job function publishes the stream's terminal event itself; the loop then
  writes arq's result and removes the job's records and its lease in one step
  (worker/arq_seam.py), unless they are not this run's (the job function raises
  ``NotFinishedHere``): another run of the job took its stream over, the job was given up
  with Redis away, or its engine died, and its lease's expiry continues it. Records Redis
  could not take keep their lease, whose expiry finishes them.
- **Drain.** A signal stops the claims; running jobs get the drain time to finish, then their
  tasks are cancelled (the job function ends them with ``shutdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog
from redis.asyncio import Redis

from edgeq.core.connection import REDIS_ERRORS, tls_hint
from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import retry_key, wake_channel
from edgeq.core.ledger import queued_scope, unanswered_scope
from edgeq.core.protocol import ErrorEvent
from edgeq.core.tasks import cancel_and_wait
from edgeq.worker.arq_seam import (
    ARQ_ABORT_SET,
    START_COUNT_TTL_S,
    Deserializer,
    JobRecord,
    SerializationError,
    Serializer,
    finish_job,
    read_job,
    result_record,
    take_aborts,
)
from edgeq.worker.claim import ClaimedJob, claim_due_jobs
from edgeq.worker.outcomes import Ending, NotStarted, not_started
from edgeq.worker.refill import RecentFinishes
from edgeq.worker.running import RunningJob, RunningJobs

# An idle worker also looks at the queue this often, for producers that do not signal.
IDLE_WAIT_S = 1.0
# After a Redis error while waiting for wakes, subscribe again after this long.
WAIT_RETRY_S = 0.5
# After a Redis error in a claim, pause this long before the next (the engine stays warm).
REDIS_RETRY_S = 0.5

log = structlog.get_logger("edgeq.worker")


@dataclass(frozen=True, slots=True)
class StartedJob:
    """A job as its function gets it."""

    job_id: str
    #: 1 on its first start; more for a job handed over after its worker died.
    job_try: int
    enqueued_ms: int
    #: The decoded argument of the job (for a chat, a ``JobPayload``).
    payload: Any


JobFunction = Callable[[StartedJob], Awaitable[Any]]


class NotFinishedHere(Exception):
    """Raised by a job function whose job's records (arq's, and the lease) this run must leave
    alone: another run of the job took its stream (this worker was thought dead and the job
    was handed over), it was given up with Redis away past EDGEQ_REDIS_OUTAGE_S, or its engine
    died and it was handed over; its lease's expiry is to continue it (docs/guarantees.md).
    The loop then writes no result and removes nothing."""

    def __init__(self, job_id: str, *, cause: BaseException | None = None) -> None:
        super().__init__(job_id)
        self.job_id = job_id
        #: A failure the loop logs as the job's own (``job_raised``): a dead engine.
        self.cause = cause


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """How the loop claims and keeps jobs (the worker fills it from its settings)."""

    queue: str
    max_jobs: int
    #: Free slots batch jobs never take, so a chat arriving while batch work fills the box
    #: starts at once (EDGEQ_RESERVED_SLOTS).
    reserved_slots: int = 0
    poll_delay_s: float = 0.25
    lease_ttl_ms: int = 10_000
    #: How long a claimed job's in-progress mark and payload are kept: as long as it may run.
    in_progress_ttl_ms: int = 310_000
    #: A backstop behind the job function's own timeout (which publishes a proper event).
    job_timeout_s: float = 310.0
    #: Starts a job may have: its first, then one per continuation.
    max_tries: int = 1
    keep_result_s: float = 60.0
    #: arq's abort set, or the queue's own on a Redis Cluster.
    abort_set: str = ARQ_ABORT_SET
    #: EDGEQ_MODEL: what a job that fails before it starts is counted under in the usage
    #: ledger ('': not counted there; its reservation is settled all the same).
    model: str = ""

    @property
    def scan_limit(self) -> int:
        """How many due jobs a claim looks at (arq's ``queue_read_limit``)."""
        return max(self.max_jobs * 5, 100)


@dataclass
class JobLoop:
    """Claims jobs from one queue and runs them, up to ``config.max_jobs`` at once."""

    redis: Redis
    config: LoopConfig
    run_job: JobFunction
    events: EventLog
    deserializer: Deserializer
    serializer: Serializer
    #: Where finished jobs' records are kept a while, to write again into a Redis that came
    #: back without them (worker/refill.py); None: not kept.
    recent: RecentFinishes | None = None
    #: Called with the error code of each job failed before it started (metrics).
    count_not_started: Callable[[str], None] = lambda code: None
    #: False while the engine is stalled (worker/liveness.py): no claims until it steps.
    may_claim: Callable[[], bool] = lambda: True
    #: Running jobs: id -> its task, and its tenant while the job function serves it (the
    #: worker's one registry: its state reads the same, for leases and counts).
    running: RunningJobs = field(default_factory=RunningJobs)
    #: False once a drain began: no more claims.
    accepting: bool = field(default=True, init=False)
    #: Running jobs cancelled by an abort (their CancelledError is no failure to log).
    _aborting: set[str] = field(default_factory=set, init=False)
    #: Set by a wake message and by a job's end; the loop claims when it is set.
    _work: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _stopped: bool = field(default=False, init=False)
    #: When running jobs are next checked for aborts (time.monotonic()).
    _next_abort_check: float = field(default=0.0, init=False)

    # --- the loop ---------------------------------------------------------------------------

    async def serve(self) -> None:
        """Claim and run jobs until ``drain`` ends the loop (or the task is cancelled)."""
        listener = asyncio.create_task(self._listen_for_wakes())
        try:
            while not self._stopped:
                if listener.done():  # not a Redis outage (it rides those out): stop
                    listener.result()
                # Cleared before the claim: a signal during its round trip claims again.
                self._work.clear()
                await self._poll()
                await self._wait_for_work()
        finally:
            await cancel_and_wait(listener)

    async def _poll(self) -> None:
        try:
            if self.accepting and self.may_claim() and len(self.running) < self.config.max_jobs:
                await self._claim_and_start()
            # Aborts every poll delay, not on every wake and job end: that round trip would
            # stand between a wake that came during it and the next claim.
            if self.running and time.monotonic() >= self._next_abort_check:
                self._next_abort_check = time.monotonic() + self.config.poll_delay_s
                await self._cancel_aborted()
        except REDIS_ERRORS as error:
            log.warning(
                "redis_unavailable", error=f"{type(error).__name__}: {error}{tls_hint(error)}"
            )
            await asyncio.sleep(REDIS_RETRY_S)

    def wake(self) -> None:
        """Look for jobs now (claims may have been held)."""
        self._work.set()

    async def _wait_for_work(self) -> None:
        busy = bool(self.running) or not self.accepting
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.poll_delay_s if busy else IDLE_WAIT_S):
                await self._work.wait()

    async def _listen_for_wakes(self) -> None:
        """Set the work signal for every message on the queue's wake channel, for good: a
        Redis error closes the subscription, and it is made again after WAIT_RETRY_S."""
        while True:
            wakes = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await wakes.subscribe(wake_channel(self.config.queue))
                self._work.set()  # a wake sent while not subscribed was missed: look now
                while True:
                    if await wakes.get_message(timeout=IDLE_WAIT_S) is not None:
                        self._work.set()
            except REDIS_ERRORS:
                await asyncio.sleep(WAIT_RETRY_S)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await asyncio.shield(wakes.aclose())

    # --- claim and start --------------------------------------------------------------------

    async def _claim_and_start(self) -> None:
        free_slots = self.config.max_jobs - len(self.running)
        claimed_ms = int(time.time() * 1000)
        claimed = await claim_due_jobs(
            self.redis,
            self.config.queue,
            wanted=free_slots,
            wanted_batch=max(0, free_slots - self.config.reserved_slots),
            scan_limit=self.config.scan_limit,
            ttl_ms=self.config.in_progress_ttl_ms,
            lease_ttl_ms=self.config.lease_ttl_ms,
            now_ms=claimed_ms,
            abort_set=self.config.abort_set,
        )
        for job in claimed:
            task = asyncio.create_task(self._run(job))
            self.running[job.job_id] = RunningJob(task)
            task.add_done_callback(partial(self._job_ended, job.job_id))

    def _job_ended(self, job_id: str, task: asyncio.Task[None]) -> None:
        self.running.pop(job_id, None)
        self._work.set()  # a slot came free: take what waits for it
        # A Redis call of the loop's own failed (arq's records, or a not-started job's error
        # event): the job keeps its lease, whose expiry hands it over or ends it (core/leases.py).
        # Said here, where it is known, not as "exception never retrieved" at exit.
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning(
                "job_records_unfinished", job_id=job_id, error=f"{type(error).__name__}: {error}"
            )

    async def _run(self, job: ClaimedJob) -> None:
        """Start one claimed job, run it and finish it."""
        record, reason = self._readable(job)
        if reason is not None:
            return await self._fail_before_start(job, record, reason)
        assert record is not None
        job_try = job.job_try
        if record.enqueued_try and record.enqueued_try > job_try:
            # arq's own start count, set by a producer (``_job_try``): it counts from there.
            job_try = record.enqueued_try
            await self.redis.setex(retry_key(job.job_id), START_COUNT_TTL_S, str(job_try))
        started = StartedJob(
            job.job_id, job_try, record.enqueued_ms, record.args[0] if record.args else None
        )
        started_ms = int(time.time() * 1000)
        try:
            async with asyncio.timeout(self.config.job_timeout_s):
                result, success = await self.run_job(started), True
        except NotFinishedHere as left:  # its records are another run's: leave them
            if left.cause is not None:
                log.error("job_raised", job_id=job.job_id, error=type(left.cause).__name__)
            self._aborting.discard(job.job_id)
            return
        except (Exception, asyncio.CancelledError) as error:
            # An abort, the backstop timeout, a failure or the drain: the job function has
            # ended its stream already; the error is the arq result, as arq records it.
            if not (isinstance(error, asyncio.CancelledError) and job.job_id in self._aborting):
                log.error("job_raised", job_id=job.job_id, error=type(error).__name__)
            self._aborting.discard(job.job_id)
            result, success = error, False
        await asyncio.shield(self._finish(job, record, started.job_try, success, result,
                                          started_ms))  # fmt: skip

    def _readable(self, job: ClaimedJob) -> tuple[JobRecord | None, NotStarted | None]:
        """The job's record, or why it cannot start."""
        if job.payload is None:
            return None, (
                NotStarted.NOT_CONTINUED_IN_TIME if job.job_try > 1 else NotStarted.EXPIRED
            )
        try:
            record = read_job(job.payload, self.deserializer)
        except SerializationError:
            return None, NotStarted.UNREADABLE
        if job.aborted:
            return record, NotStarted.ABORTED
        if max(job.job_try, record.enqueued_try or 0) > self.config.max_tries:
            return record, NotStarted.STARTED_TOO_OFTEN
        return record, None

    # --- finish and fail --------------------------------------------------------------------

    async def _finish(
        self,
        job: ClaimedJob,
        record: JobRecord | None,
        job_try: int,
        success: bool,
        result: Any,
        started_ms: int,
    ) -> None:
        outcome = result_record(
            job.job_id, record, queue=self.config.queue, job_try=job_try, success=success,
            result=result, started_ms=started_ms, finished_ms=int(time.time() * 1000),
            serializer=self.serializer,
        )  # fmt: skip
        # The job is over (its terminal event is out); only its records are left to write.
        # Through a short Redis outage they are retried, so arq's result is there once Redis
        # is; past a lease TTL the lease they keep until then finishes them (arq_seam.py).
        give_up = time.monotonic() + self.config.lease_ttl_ms / 1000
        write = partial(
            finish_job,
            self.redis,
            job.job_id,
            queue=self.config.queue,
            abort_set=self.config.abort_set,
            result=outcome,
            keep_result_ms=int(self.config.keep_result_s * 1000),
        )
        while True:
            try:
                await write()
            except REDIS_ERRORS:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(REDIS_RETRY_S)
                continue
            if self.recent is not None:
                self.recent.keep_records(job.job_id, write)
            return

    async def _fail_before_start(
        self, job: ClaimedJob, record: JobRecord | None, reason: NotStarted
    ) -> None:
        """End a job that cannot start with its one error event, and arq's records with it."""
        ending: Ending = not_started(reason)
        now_ms = int(time.time() * 1000)
        self.count_not_started(ending.code.value)
        event = ErrorEvent(job_id=job.job_id, seq=0, code=ending.code.value, message=ending.message)
        # The event first, as a job that ran ends: should Redis fail in between, the lease
        # taken at the claim stays, and its expiry ends the job or hands it to a next claim.
        # Counted in the ledger under its payload, or, an expired job's being gone, where it
        # was queued; its reservation is settled in the event's step either way.
        scope = unanswered_scope(job.payload, self.config.model) or queued_scope(
            job.queued_as, self.config.model
        )
        try:
            published = await self.events.append(event, ledger=scope)
            log.info("job_failed", job_id=job.job_id, code=ending.code.value,
                     reason=ending.message)  # fmt: skip
            if self.recent is not None:
                stored = event.model_copy(update={"seq": published.seq})
                self.recent.keep_events(job.job_id, [stored], tenant=None, ledger=scope)
        except StreamClosed:
            pass  # already ended (cancelled, or declared lost): one terminal event only
        await asyncio.shield(
            self._finish(job, record, job.job_try, False, ending.as_result(), now_ms)
        )

    # --- cancel -----------------------------------------------------------------------------

    async def _cancel_aborted(self) -> None:
        aborted = await take_aborts(self.redis, self.config.abort_set, list(self.running))
        for job_id in aborted:
            if (running := self.running.get(job_id)) is not None:
                self._aborting.add(job_id)
                running.task.cancel()

    # --- drain ------------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Take no more jobs; give the running ones ``timeout_s`` to finish, cancel the rest
        (they end with ``shutdown``), wait for them to end, then end the loop."""
        self.accepting = False
        self._work.set()
        if running := self.running.tasks():
            await asyncio.wait(running, timeout=timeout_s)
        await self.cancel_running()
        self._stopped = True
        self._work.set()

    async def cancel_running(self) -> None:
        """Cancel every running job and wait until each has ended its stream."""
        running = self.running.tasks()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def run_until_signalled(
    jobs: JobLoop,
    *,
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    on_drain: Callable[[], None],
    drain_timeout_s: float,
) -> None:
    """The worker process's life: ``start`` (build the engine), serve jobs until SIGTERM or
    SIGINT, drain, ``stop``. A signal during ``start`` stops the start-up; a second signal
    during a drain cancels the running jobs at once."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    draining: list[asyncio.Task[None]] = []
    serving = False

    def signalled(signum: signal.Signals) -> None:
        if draining:
            log.warning("worker_drain_cut_short", signal=signum.name)
            draining.append(asyncio.create_task(jobs.cancel_running()))
            return
        on_drain()
        if not serving:
            main.cancel()
        draining.append(asyncio.create_task(jobs.drain(drain_timeout_s)))

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signalled, signum)
    try:
        await start()
        serving = True
        await jobs.serve()
    except asyncio.CancelledError:
        if not draining:  # cancelled from outside, not by a signal: not ours to swallow
            raise
        main.uncancel()  # a signal during start-up: stop here, cleanly
    finally:
        await asyncio.gather(*draining, return_exceptions=True)
        await jobs.cancel_running()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await stop()
