"""The chat job: run one chat on the warm engine and publish its events.

Every path out of ``chat`` publishes exactly one terminal event: ``done`` with usage and
timings, or ``error`` with a stable code (worker/outcomes.py). The same terminal outcome is
the job's arq result (worker/arq_seam.py). The one exception is a dead engine: the job is
then handed over unended (its engine failure counted on it first), for another worker, or this
one restarted, to continue; at two such failures the hand-over quarantines it instead.

A job the loop starts for the second time was handed over after its worker (or its worker's
engine) died (core/leases.py): its stream already holds what the dead worker published. It is
continued: the prompt is the chat plus the answer text streamed so far, and its new text
follows the old in the same stream, under the next ``seq``. What cannot be continued from the
middle (a constrained answer, logprobs, ``on_worker_lost="fail"``) ends with ``worker_lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

import structlog
from vllm.v1.engine.exceptions import EngineDeadError

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.errors import StreamClosed
from edgeq.core.events import AnyEvent, StreamTaken, read_events
from edgeq.core.leases import hand_over_after_engine_failure
from edgeq.core.ledger import LedgerScope
from edgeq.core.protocol import ErrorCode, Usage
from edgeq.worker.chat_run import ChatRun
from edgeq.worker.lifecycle import NotFinishedHere, StartedJob
from edgeq.worker.outcomes import Ending, JobRefused, job_failure
from edgeq.worker.publisher import RedisAway, StreamPublisher
from edgeq.worker.state import WorkerState
from edgeq.worker.wire import JobPayload

log = structlog.get_logger("edgeq.job")


async def chat(state: WorkerState, job: StartedJob) -> dict[str, Any]:
    """The job function the loop runs (worker/lifecycle.py); ``job.payload`` comes from
    ``edgeq.worker.wire.load_job``. Returns the job's result: the answer, or its error event."""
    payload: JobPayload = job.payload
    structlog.contextvars.bind_contextvars(job_id=job.job_id)
    continued = job.job_try - 1  # starts before this one
    earlier = await read_events(state.redis, job.job_id) if continued else []
    publisher = _publisher(state, job, earlier)
    state.running.serving(job.job_id, payload.tenant)
    outcome = ErrorCode.ENGINE_ERROR.value  # what the metrics count unless a path says better
    e2e_s: float | None = None  # for jobs that end with done
    usage: Usage | None = None
    finished_here = True  # else it ends (and counts) elsewhere
    try:
        async with asyncio.timeout(state.settings.job_timeout_s):
            # Built in here: an engine not started (a bug) ends the job with its error event.
            run = ChatRun(
                state.ready_engine, state.settings, state.metrics, publisher,
                job.enqueued_ms / 1000, earlier=earlier, continued=continued,
                adapters=state.adapters,
            )  # fmt: skip
            result = await run.run(payload)
        # The same clock reading as the done event's total_ms: metric and event agree.
        outcome, e2e_s, usage = "done", result.timings.total_ms / 1000, result.usage
        return result.model_dump(mode="json", exclude_none=True)
    except (Exception, asyncio.CancelledError) as error:
        ending = job_failure(error, state.settings, draining=state.draining.is_set())
        outcome = ending.code.value
        # Decided before any await: a job cut short while it ends keeps it too.
        finished_here = _finished_here(error)
        try:
            failure = await _end_with(publisher, ending, error, state)
        finally:
            if not finished_here:  # the loop leaves its records alone (worker/lifecycle.py)
                cause = error if isinstance(error, EngineDeadError) else None
                raise NotFinishedHere(job.job_id, cause=cause) from error
        if isinstance(error, asyncio.CancelledError):
            raise
        return failure
    finally:
        state.metrics.job_ended(outcome, e2e_s=e2e_s)
        if finished_here:
            _count_end(state, job.job_id, payload.tenant, publisher, outcome, usage)
        # No more renewals; the lease itself goes with arq's records, when the loop finishes
        # them (worker/lifecycle.py): released here, it left records Redis could not take
        # (an outage at the job's end) in the queue and in progress for good (#34).
        state.running.served(job.job_id)
        structlog.contextvars.unbind_contextvars("job_id")


def _publisher(state: WorkerState, job: StartedJob, earlier: list[AnyEvent]) -> StreamPublisher:
    """The job's publisher: its stream, after what a dead worker published (``earlier``)."""
    payload: JobPayload = job.payload
    settings = state.settings
    return StreamPublisher(
        state.events,
        job.job_id,
        interval_s=settings.stream_interval_ms / 1000,
        outage_limit_s=settings.redis_outage_s,
        earlier=earlier,
        tenant=payload.tenant,
        ledger=LedgerScope(payload.tenant, settings.model, payload.priority, payload.key_name),
    )


def _count_end(
    state: WorkerState,
    job_id: str,
    tenant: str,
    publisher: StreamPublisher,
    outcome: str,
    usage: Usage | None,
) -> None:
    """What a job that ended here counts and keeps: its tenant's tally and its events for a
    refill (worker/refill.py). Its reserved tokens were settled in the step that wrote its
    terminal event (core/events.py): no round trip of their own."""
    state.metrics.tenant_job_ended(tenant, outcome, usage)
    if publisher.closed:
        state.recent.keep_events(job_id, publisher.stored, tenant, publisher.ledger)


def _finished_here(error: BaseException) -> bool:
    """Whether a job that failed with ``error`` ends here. Not when another run of it took
    its stream (the records are that run's), when it was given up with Redis away (its
    lease's expiry, once Redis is back, continues it or ends it worker_lost: finished here,
    it was gone with no end for its client to see, #34), or when its engine died (it is
    handed over, and its records stay for the next run)."""
    return not isinstance(error, StreamTaken | RedisAway | EngineDeadError)


# Causes whose error event says all there is (job_failed logs it): no traceback for them.
_ENDINGS_LOGGED_ELSEWHERE = (JobRefused, TimeoutError, asyncio.CancelledError, EngineDeadError)


async def _end_with(
    publisher: StreamPublisher, ending: Ending, error: BaseException, state: WorkerState
) -> dict[str, Any]:
    """Publish a failed job's error event (where its stream can take one), log why, and do
    what its cause asks beyond that."""
    if isinstance(error, StreamClosed):
        # Someone else ended the stream (a cancel, or a reaper that thought us lost), or took
        # it over (we were thought dead): the generation was abandoned, which aborted its
        # engine request.
        taken = isinstance(error, StreamTaken)
        log.info(
            "job_stopped",
            reason="another run of the job took its stream"
            if taken
            else "its stream was ended elsewhere (cancel or worker_lost)",
            engine_unfinished_requests=state.ready_engine.unfinished_requests(),
        )
    elif isinstance(error, RedisAway):
        # No terminal event could go out: the records and the lease stay (_finished_here).
        log.warning("job_abandoned", reason=ending.message)
    elif not isinstance(error, _ENDINGS_LOGGED_ELSEWHERE):
        log.exception("job_error")
    if isinstance(error, EngineDeadError):
        await _hand_over_from_dead_engine(state, publisher.job_id)
    failure = await _fail(publisher, ending) if ending.publish else ending.as_result()
    if isinstance(error, EngineDeadError):
        log.error("engine_dead", action="stopping worker so its supervisor restarts it")
        state.engine_died = True
        os.kill(os.getpid(), signal.SIGTERM)
    return failure


async def _hand_over_from_dead_engine(state: WorkerState, job_id: str) -> None:
    """A job whose engine died is continued by another worker (or this one restarted), like
    a killed worker's, and not ended: the chat most likely did not kill the engine. The
    death is counted on it first (a job at two is quarantined, core/leases.py), and its
    lease let run out at once, so the next keep-alive round anywhere hands it over."""
    state.running.served(job_id)  # no renewal after the expiry below
    with contextlib.suppress(*REDIS_ERRORS):  # else its lease runs out by itself
        await hand_over_after_engine_failure(state.redis, state.settings.queue, [job_id])


async def _fail(publisher: StreamPublisher, ending: Ending) -> dict[str, Any]:
    log.info("job_failed", code=ending.code.value, reason=ending.message)
    if publisher.closed:  # the terminal event is out; a second one would break the contract
        return ending.as_result()
    try:
        event = await asyncio.shield(publisher.publish_error(ending.code.value, ending.message))
    except (StreamClosed, RedisAway):
        return ending.as_result()
    return event.model_dump(mode="json")
