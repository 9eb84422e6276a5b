"""Assembling and running the arq worker around one warm engine.

arq's defaults fight this design (see ../shared/notes/arq-redis.md), so each one that matters
is set here on purpose: JSON instead of pickle, a short poll delay, ``max_jobs`` following the
engine's batch, one try per chat, aborts allowed, a finite timeout, no arguments or results in
arq's log lines.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import structlog
from arq.worker import Worker, func

from producer.client import make_redis
from producer.protocol import JOB_FUNCTION
from worker.engine import ChatEngine
from worker.jobs import chat
from worker.settings import WorkerSettings
from worker.wire import dump_json, load_job

# arq's own timeout is a backstop behind the job's (which publishes a proper `timeout` event).
ARQ_TIMEOUT_MARGIN_S = 10.0
# Often enough that `arq --check` style liveness is meaningful, rarely enough to cost nothing.
HEALTH_CHECK_INTERVAL_S = 10

log = structlog.get_logger("edgeq.worker")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def start_engine(ctx: dict[str, Any]) -> None:
    """arq's on_startup: build and warm the engine before the first job is picked."""
    settings: WorkerSettings = ctx["settings"]
    began = time.monotonic()
    engine = await ChatEngine.start(settings)
    built = time.monotonic()
    if settings.warmup:
        await engine.warm_up()
    ctx["engine"] = engine
    log.info(
        "worker_ready",
        worker=worker_id(),
        model=settings.model,
        queue=settings.queue,
        max_model_len=engine.max_model_len,
        max_jobs=settings.arq_max_jobs,
        engine_build_s=round(built - began, 2),
        warmup_s=round(time.monotonic() - built, 3),
        since_process_start_s=round(time.monotonic() - ctx["process_started"], 2),
    )


async def stop_engine(ctx: dict[str, Any]) -> None:
    engine: ChatEngine | None = ctx.pop("engine", None)
    if engine is not None:
        engine.shutdown()
    log.info("worker_stopped", worker=worker_id())


def build_worker(settings: WorkerSettings, *, process_started: float) -> Worker:
    redis = make_redis(settings, job_serializer=dump_json, job_deserializer=load_job)
    return Worker(
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
        ctx={"settings": settings, "process_started": process_started},
    )


def run_worker(settings: WorkerSettings, *, process_started: float) -> None:
    """Run until SIGINT/SIGTERM; in-flight chats end with a `cancelled` error event."""
    build_worker(settings, process_started=process_started).run()
