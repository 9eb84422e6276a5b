"""Assembling and running the arq worker around one warm engine.

arq's defaults fight this design (README, "How the worker runs"), so each one that matters
is set here on purpose: JSON instead of pickle, a short poll delay, ``max_jobs`` following the
engine's batch, one try per chat, aborts allowed, a finite timeout, no arguments or results in
arq's log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
from arq.worker import func

from edgeq.core.cluster import is_cluster_url
from edgeq.core.connection import REDIS_ERRORS, make_redis, tls_hint
from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import cluster_abort_set_key, health_check_key
from edgeq.core.leases import (
    LOST_MESSAGE,
    Handover,
    reap_lost_jobs,
    release_lease,
    renew_leases,
)
from edgeq.core.protocol import JOB_FUNCTION, ErrorCode, ErrorEvent
from edgeq.core.registry import WorkerInfo, publish_heartbeat, queue_depth, remove_worker
from edgeq.core.scheduling import publish_tenancy, queued_by_tenant
from edgeq.core.tasks import cancel_and_wait
from edgeq.worker.engine import ChatEngine
from edgeq.worker.jobs import chat
from edgeq.worker.metrics import WorkerMetrics, serve_metrics
from edgeq.worker.notify import keep_watchdog, notify, watchdog_interval_s
from edgeq.worker.pickup import FastPickupWorker
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.state import STATE_KEY, WorkerState, running_by_tenant, worker_state
from edgeq.worker.wire import dump_json, load_job

# arq's own timeout is a backstop behind the job's (which publishes a proper `timeout` event).
ARQ_TIMEOUT_MARGIN_S = 10.0
# Often enough that `arq --check` style liveness is meaningful, rarely enough to cost nothing.
HEALTH_CHECK_INTERVAL_S = 10
# Leases are renewed this many times per lease TTL, so one late renewal is not a lost job.
LEASE_RENEWALS_PER_TTL = 4
# While Redis is unreachable the worker keeps its warm engine and tries again this often.
REDIS_RETRY_S = 0.5

log = structlog.get_logger("edgeq.worker")

#: Builds the worker's one engine from its settings: vLLM's (``ChatEngine.start``), or a
#: stand-in at a GPU's token rate for capacity runs (edgeq.bench.simulate).
EngineStarter = Callable[[WorkerSettings], Awaitable[ChatEngine]]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def early_failure(result_data: bytes | None) -> tuple[ErrorCode, str]:
    """The error event for a job arq failed without running it (README, "Guarantees")."""
    try:
        outcome = json.loads(result_data or b"{}").get("r") or {}
    except (ValueError, AttributeError):
        outcome = {}
    name = outcome.get("exception", "") if isinstance(outcome, dict) else ""
    said = outcome.get("message", "") if isinstance(outcome, dict) else str(outcome)
    if said == "job expired" and _starts(result_data) > 1:
        return ErrorCode.WORKER_LOST, LOST_MESSAGE.format(
            why="no worker took it over within EDGEQ_CONTINUE_WITHIN_S"
        )
    if said == "job expired":
        return ErrorCode.EXPIRED, (
            "the job was not started before its queue deadline (EDGEQ_QUEUE_DEADLINE_S or "
            "the deadline given at submit); it never ran"
        )
    if "retries exceeded" in said:
        return ErrorCode.WORKER_LOST, LOST_MESSAGE.format(
            why="it was started as often as EDGEQ_MAX_CONTINUATIONS allows"
        )
    if name == "CancelledError":
        return ErrorCode.CANCELLED, "the job was aborted before it started"
    return ErrorCode.ENGINE_ERROR, f"the job failed before it started: {name or said}"


def _starts(result_data: bytes | None) -> int:
    """How often arq had started the job (its ``job_try``), from a failure's result data."""
    try:
        starts = json.loads(result_data or b"{}").get("t")
    except (ValueError, AttributeError):
        return 0
    return starts if isinstance(starts, int) else 0


class EdgeqWorker(FastPickupWorker):
    """arq's Worker, plus what edgeq's guarantees need from it:

    - jobs arq fails without running them (expired, aborted, re-delivered after a crash) still
      end with an error event, so no subscriber waits for nothing;
    - a Redis outage does not end the process (and its warm engine): it waits and retries;
    - a drain (SIGTERM) is visible to the jobs it cuts short, which end with ``shutdown``.
    """

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        await super().finish_failed_job(job_id, result_data)
        code, message = early_failure(result_data)
        event = ErrorEvent(job_id=job_id, seq=0, code=code.value, message=message)
        state = worker_state(self.ctx)
        state.metrics.job_ended(code.value)
        try:
            await release_lease(state.redis, state.settings.queue, job_id)  # leased at claim
            await state.events.append(event)
            log.info("job_failed", job_id=job_id, code=code.value, reason=message)
        except StreamClosed:
            pass  # already ended (cancelled, or declared lost): one terminal event only

    async def finish_job(self, job_id: str, *args: Any, **kwargs: Any) -> None:
        # A run whose stream another run took must not finish the job for it (arq would
        # delete the payload and in-progress keys the other run still needs).
        superseded = worker_state(self.ctx).superseded
        if job_id in superseded:
            superseded.discard(job_id)
            return
        await super().finish_job(job_id, *args, **kwargs)

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except REDIS_ERRORS as error:
            log.warning(
                "redis_unavailable", error=f"{type(error).__name__}: {error}{tls_hint(error)}"
            )
            await asyncio.sleep(REDIS_RETRY_S)

    def handle_sig_wait_for_completion(self, signum: Any) -> None:
        worker_state(self.ctx).draining.set()  # the one state object every job's ctx holds
        log.info("worker_draining", drain_timeout_s=self._job_completion_wait)
        notify("STOPPING=1\nSTATUS=draining")
        super().handle_sig_wait_for_completion(signum)


def describe_worker(state: WorkerState, now_s: float) -> WorkerInfo:
    settings = state.settings
    return WorkerInfo(
        worker_id=worker_id(),
        host=socket.gethostname(),
        pid=os.getpid(),
        queue=settings.queue,
        model=settings.model,
        profile=settings.profile,
        device=state.device,
        state="draining" if state.draining.is_set() else "ready",
        running=len(state.running),
        running_by_tenant=running_by_tenant(state),
        max_jobs=settings.arq_max_jobs,
        metrics_port=settings.metrics_port or None,
        started_at=state.started_at,
        heartbeat_at=now_s,
    )


async def keep_alive(state: WorkerState) -> None:
    """Each lease period: renew the leases of this worker's running jobs, end other workers'
    lost jobs, and say this worker is alive (``edgeq status``, the gateway's /ready)."""
    settings, redis = state.settings, state.redis
    period_s = settings.lease_ttl_s / LEASE_RENEWALS_PER_TTL
    while True:
        began = time.monotonic()
        try:
            await renew_leases(
                redis, settings.queue, list(state.running), ttl_s=settings.lease_ttl_s
            )
            handed = await reap_lost_jobs(
                redis,
                state.events,
                queue=settings.queue,
                max_continuations=settings.max_continuations,
                deadline_s=settings.continue_within_s,
                lease_ttl_s=settings.lease_ttl_s,
            )
            for job_id, outcome in handed.items():
                log.warning(
                    "job_handed_over" if outcome is Handover.CONTINUED else "job_lost",
                    job_id=job_id,
                    reason="its worker's lease ran out",
                )
            await publish_heartbeat(
                redis, describe_worker(state, time.time()), ttl_s=settings.lease_ttl_s
            )
            state.metrics.waiting.set((await queue_depth(redis, settings.queue)).waiting)
            state.metrics.count_tenants(
                running=running_by_tenant(state),
                waiting=await queued_by_tenant(redis, settings.queue),
            )
        except REDIS_ERRORS as error:
            log.warning("lease_renewal_failed", error=f"{type(error).__name__}: {error}")
        # A period from the start of this round, not from its end: on a loaded event loop a
        # round's round trips can take seconds, and leases must not wait for them on top.
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - began)))


def freeze_startup_heap() -> int:
    """Put what start-up built out of the garbage collector's sight; how many objects that is.

    Importing vLLM and torch and building the engine leaves ~680k objects the collector
    tracks, and they live as long as the worker. A full collection, which Python starts on
    its own once enough objects have outlived two younger ones, walks them all: ~0.3 s on
    these CPU boxes with the event loop, and so every running stream, stopped. Frozen, they
    are skipped: one then takes ~0.1 ms (docs/benchmarks-history.md, "One full garbage collection in
    a warm worker"). vLLM's own server and engine core do the same after their start-up."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def start_engine(ctx: dict[str, Any], *, starter: EngineStarter = ChatEngine.start) -> None:
    """arq's on_startup: build and warm the engine before the first job is picked."""
    state = worker_state(ctx)
    settings = state.settings
    # First, so producers' enqueues apply this box's weights and caps while the engine builds.
    await publish_tenancy(state.redis, settings.queue, settings.tenancy)
    began = time.monotonic()
    engine = await starter(settings)
    built = time.monotonic()
    if settings.warmup:
        await engine.warm_up()
    frozen_objects = freeze_startup_heap()
    state.engine = engine
    state.device = engine.device
    state.background.append(asyncio.create_task(keep_alive(state)))
    log.info(
        "worker_ready",
        worker=worker_id(),
        model=settings.model,
        queue=settings.queue,
        max_model_len=engine.max_model_len,
        max_jobs=settings.arq_max_jobs,
        device=state.device,
        metrics_port=settings.metrics_port or None,
        engine_build_s=round(built - began, 2),
        warmup_s=round(time.monotonic() - built, 3),
        gc_frozen_objects=frozen_objects,
        since_process_start_s=round(time.monotonic() - state.process_started, 2),
    )
    notify(f"READY=1\nSTATUS=warm, serving {settings.queue} with {settings.model}")
    if (interval_s := watchdog_interval_s()) is not None:
        state.background.append(asyncio.create_task(keep_watchdog(interval_s)))


async def stop_engine(ctx: dict[str, Any]) -> None:
    state = worker_state(ctx)
    background, state.background = state.background, []
    await cancel_and_wait(*background)  # the keep-alive round and the watchdog: sleep loops
    with contextlib.suppress(*REDIS_ERRORS):  # else its record expires within a lease
        await remove_worker(state.redis, state.settings.queue, worker_id())
    engine, state.engine = state.engine, None
    if engine is not None:  # seconds of waiting for its processes to exit: off the loop
        await asyncio.to_thread(engine.shutdown)
    log.info("worker_stopped", worker=worker_id())


def build_worker(
    settings: WorkerSettings,
    *,
    process_started: float,
    metrics: WorkerMetrics,
    engine_starter: EngineStarter = ChatEngine.start,
) -> EdgeqWorker:
    redis = make_redis(settings, job_serializer=dump_json, job_deserializer=load_job)
    state = WorkerState(
        settings=settings,
        redis=redis,
        events=EventLog(redis, replay_ttl_s=settings.replay_ttl_s, queue=settings.queue),
        metrics=metrics,
        process_started=process_started,
        started_at=time.time(),
    )
    metrics.count_running(lambda: len(state.running))
    return EdgeqWorker(
        functions=[
            func(
                chat,
                name=JOB_FUNCTION,
                # A start after the first continues the stream where it stopped (jobs.py).
                max_tries=settings.max_continuations + 1,
                timeout=settings.job_timeout_s + ARQ_TIMEOUT_MARGIN_S,
            )
        ],
        queue_name=settings.queue,
        redis_pool=redis,
        on_startup=partial(start_engine, starter=engine_starter),
        on_shutdown=stop_engine,
        max_jobs=settings.arq_max_jobs,
        poll_delay=settings.poll_delay_ms / 1000,
        keep_result=settings.keep_result_s,
        max_tries=1,
        retry_jobs=False,
        allow_abort_jobs=True,
        log_results=False,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        health_check_key=health_check_key(settings.queue, worker_id()),
        job_serializer=dump_json,
        job_deserializer=load_job,
        job_completion_wait=settings.drain_timeout_s,
        # Shared by reference with each job's ctx (arq copies the dict, not its values).
        ctx={STATE_KEY: state},
    )


def run_worker(
    settings: WorkerSettings,
    *,
    process_started: float,
    engine_starter: EngineStarter = ChatEngine.start,
) -> None:
    """Run until SIGINT/SIGTERM: stop taking jobs, let running chats finish for up to
    EDGEQ_DRAIN_TIMEOUT_S, end the rest with a `shutdown` error event."""
    metrics = WorkerMetrics(tenants=settings.tenancy.named_tenants)
    if settings.metrics_port:
        serve_metrics(settings.metrics_host, settings.metrics_port)
    worker = build_worker(
        settings, process_started=process_started, metrics=metrics, engine_starter=engine_starter
    )
    worker.fast_pickup = settings.fast_pickup
    worker.lease_ttl_ms = int(settings.lease_ttl_s * 1000)
    worker.reserved_slots = settings.arq_reserved_slots
    if is_cluster_url(settings.redis_url):
        worker.abort_set = cluster_abort_set_key(settings.queue)
    worker.run()
