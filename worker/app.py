"""Assembling and running the arq worker around one warm engine.

arq's defaults fight this design (see ../shared/notes/arq-redis.md), so each one that matters
is set here on purpose: JSON instead of pickle, a short poll delay, ``max_jobs`` following the
engine's batch, one try per chat, aborts allowed, a finite timeout, no arguments or results in
arq's log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from typing import Any

import redis.exceptions
import structlog
from arq.worker import func

from producer.client import make_redis
from producer.protocol import JOB_FUNCTION, ErrorCode, ErrorEvent
from producer.streams import EventLog, StreamClosed, reap_lost_jobs, renew_leases
from producer.workers import WorkerInfo, publish_heartbeat, queue_depth, remove_worker
from worker.engine import ChatEngine, describe_device
from worker.jobs import chat
from worker.metrics import WorkerMetrics, serve_metrics
from worker.notify import keep_watchdog, notify, watchdog_interval_s
from worker.pickup import FastPickupWorker
from worker.settings import WorkerSettings
from worker.wire import dump_json, load_job

# arq's own timeout is a backstop behind the job's (which publishes a proper `timeout` event).
ARQ_TIMEOUT_MARGIN_S = 10.0
# Often enough that `arq --check` style liveness is meaningful, rarely enough to cost nothing.
HEALTH_CHECK_INTERVAL_S = 10
# Leases are renewed this many times per lease TTL, so one late renewal is not a lost job.
LEASE_RENEWALS_PER_TTL = 4
# While Redis is unreachable the worker keeps its warm engine and tries again this often.
REDIS_RETRY_S = 0.5
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

log = structlog.get_logger("edgeq.worker")


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
    if said == "job expired":
        return ErrorCode.EXPIRED, (
            "the job was not started before its queue deadline (EDGEQ_QUEUE_DEADLINE_S or "
            "the deadline given at submit); it never ran"
        )
    if "retries exceeded" in said:
        return ErrorCode.WORKER_LOST, (
            "a worker took this job and stopped before finishing it; the job was not re-run, "
            "so it is safe to submit it again"
        )
    if name == "CancelledError":
        return ErrorCode.CANCELLED, "the job was aborted before it started"
    return ErrorCode.ENGINE_ERROR, f"the job failed before it started: {name or said}"


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
        self.ctx["metrics"].job_ended(code.value)
        try:
            await self.ctx["events"].append(event)
            log.info("job_failed", job_id=job_id, code=code.value, reason=message)
        except StreamClosed:
            pass  # already ended (cancelled, or declared lost): one terminal event only

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except REDIS_ERRORS as error:
            log.warning("redis_unavailable", error=f"{type(error).__name__}: {error}")
            await asyncio.sleep(REDIS_RETRY_S)

    def handle_sig_wait_for_completion(self, signum: Any) -> None:
        self.ctx["draining"].set()  # shared by reference with every running job's ctx
        log.info("worker_draining", drain_timeout_s=self._job_completion_wait)
        notify("STOPPING=1\nSTATUS=draining")
        super().handle_sig_wait_for_completion(signum)


def describe_worker(ctx: dict[str, Any], now_s: float) -> WorkerInfo:
    settings: WorkerSettings = ctx["settings"]
    return WorkerInfo(
        worker_id=worker_id(),
        host=socket.gethostname(),
        pid=os.getpid(),
        queue=settings.queue,
        model=settings.model,
        profile=settings.profile,
        device=ctx["device"],
        state="draining" if ctx["draining"].is_set() else "ready",
        running=len(ctx["running"]),
        max_jobs=settings.arq_max_jobs,
        metrics_port=settings.metrics_port or None,
        started_at=ctx["started_at"],
        heartbeat_at=now_s,
    )


async def keep_alive(ctx: dict[str, Any]) -> None:
    """Each lease period: renew the leases of this worker's running jobs, end other workers'
    lost jobs, and say this worker is alive (``edgeq status``, the gateway's /ready)."""
    settings: WorkerSettings = ctx["settings"]
    redis = ctx["redis"]
    period_s = settings.lease_ttl_s / LEASE_RENEWALS_PER_TTL
    while True:
        began = time.monotonic()
        try:
            await renew_leases(
                redis, settings.queue, list(ctx["running"]), ttl_s=settings.lease_ttl_s
            )
            for job_id in await reap_lost_jobs(redis, ctx["events"], queue=settings.queue):
                log.warning("job_lost", job_id=job_id, reason="its worker's lease ran out")
            await publish_heartbeat(
                redis, describe_worker(ctx, time.time()), ttl_s=settings.lease_ttl_s
            )
            ctx["metrics"].waiting.set((await queue_depth(redis, settings.queue)).waiting)
        except REDIS_ERRORS as error:
            log.warning("lease_renewal_failed", error=f"{type(error).__name__}: {error}")
        # A period from the start of this round, not from its end: on a loaded event loop a
        # round's round trips can take seconds, and leases must not wait for them on top.
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - began)))


async def start_engine(ctx: dict[str, Any]) -> None:
    """arq's on_startup: build and warm the engine before the first job is picked."""
    settings: WorkerSettings = ctx["settings"]
    ctx["events"] = EventLog(
        ctx["redis"], replay_ttl_s=settings.replay_ttl_s, queue=settings.queue, batched=True
    )
    began = time.monotonic()
    engine = await ChatEngine.start(settings)
    built = time.monotonic()
    if settings.warmup:
        await engine.warm_up()
    ctx["engine"] = engine
    ctx["device"] = describe_device(settings)
    ctx["lease_keeper"] = asyncio.create_task(keep_alive(ctx))
    log.info(
        "worker_ready",
        worker=worker_id(),
        model=settings.model,
        queue=settings.queue,
        max_model_len=engine.max_model_len,
        max_jobs=settings.arq_max_jobs,
        device=ctx["device"],
        metrics_port=settings.metrics_port or None,
        engine_build_s=round(built - began, 2),
        warmup_s=round(time.monotonic() - built, 3),
        since_process_start_s=round(time.monotonic() - ctx["process_started"], 2),
    )
    notify(f"READY=1\nSTATUS=warm, serving {settings.queue} with {settings.model}")
    if (interval_s := watchdog_interval_s()) is not None:
        ctx["watchdog"] = asyncio.create_task(keep_watchdog(interval_s))


async def stop_engine(ctx: dict[str, Any]) -> None:
    watchdog: asyncio.Task[None] | None = ctx.pop("watchdog", None)
    if watchdog is not None:
        watchdog.cancel()  # a sleep loop: nothing to wait for
    keeper: asyncio.Task[None] | None = ctx.pop("lease_keeper", None)
    if keeper is not None:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
    settings: WorkerSettings = ctx["settings"]
    with contextlib.suppress(*REDIS_ERRORS):  # else its record expires within a lease
        await remove_worker(ctx["redis"], settings.queue, worker_id())
    engine: ChatEngine | None = ctx.pop("engine", None)
    if engine is not None:
        engine.shutdown()
    log.info("worker_stopped", worker=worker_id())


def build_worker(
    settings: WorkerSettings, *, process_started: float, metrics: WorkerMetrics
) -> EdgeqWorker:
    redis = make_redis(settings, job_serializer=dump_json, job_deserializer=load_job)
    running: set[str] = set()
    metrics.count_running(lambda: len(running))
    return EdgeqWorker(
        functions=[
            func(
                chat,
                name=JOB_FUNCTION,
                max_tries=1,  # a half-streamed answer is never silently generated again
                timeout=settings.job_timeout_s + ARQ_TIMEOUT_MARGIN_S,
            )
        ],
        queue_name=settings.queue,
        redis_pool=redis,
        on_startup=start_engine,
        on_shutdown=stop_engine,
        max_jobs=settings.arq_max_jobs,
        poll_delay=settings.poll_delay_ms / 1000,
        keep_result=settings.keep_result_s,
        max_tries=1,
        retry_jobs=False,
        allow_abort_jobs=True,
        log_results=False,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        health_check_key=f"{settings.queue}:health-check:{worker_id()}",
        job_serializer=dump_json,
        job_deserializer=load_job,
        job_completion_wait=settings.drain_timeout_s,
        # Shared by reference with each job's ctx (arq copies the dict, not its values).
        ctx={
            "settings": settings,
            "process_started": process_started,
            "started_at": time.time(),
            "metrics": metrics,
            "running": running,
            "draining": asyncio.Event(),
        },
    )


def run_worker(settings: WorkerSettings, *, process_started: float) -> None:
    """Run until SIGINT/SIGTERM: stop taking jobs, let running chats finish for up to
    EDGEQ_DRAIN_TIMEOUT_S, end the rest with a `shutdown` error event."""
    metrics = WorkerMetrics()
    if settings.metrics_port:
        serve_metrics(settings.metrics_host, settings.metrics_port)
    worker = build_worker(settings, process_started=process_started, metrics=metrics)
    worker.fast_pickup = settings.fast_pickup
    worker.run()
