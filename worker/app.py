"""Assembling and running the worker around one warm engine: its state, the engine's start
and stop, the keep-alive round (leases, hand-overs, heartbeat), and the job loop
(worker/lifecycle.py) fed with the chat job (worker/jobs.py).

Jobs stay arq jobs on the wire (JSON, never pickle; worker/arq_seam.py); the loop that runs
them is edgeq's own, so each of arq's defaults that fought this design (README, "How the
worker runs") is simply not there: it claims a burst in one round trip, runs as many chats as
the engine batches, starts a chat once plus once per continuation, and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Literal

import structlog

from edgeq.core.adapters import registered as adapter_registry
from edgeq.core.cluster import is_cluster_url
from edgeq.core.connection import REDIS_ERRORS, make_redis
from edgeq.core.events import EventLog
from edgeq.core.keys import cluster_abort_set_key
from edgeq.core.leases import Handover, reap_lost_jobs, renew_leases
from edgeq.core.registry import WorkerInfo, publish_heartbeat, queue_depth, remove_worker
from edgeq.core.scheduling import publish_tenancy, queued_by_tenant
from edgeq.core.tasks import cancel_and_wait
from edgeq.exit_codes import EXIT_JOB_FAILED, EXIT_OK
from edgeq.worker.adapters import AdapterHost
from edgeq.worker.arq_seam import ARQ_ABORT_SET
from edgeq.worker.engine import ChatEngine
from edgeq.worker.engine_api import Engine
from edgeq.worker.jobs import chat
from edgeq.worker.lifecycle import JobLoop, LoopConfig, run_until_signalled
from edgeq.worker.liveness import watch_engine
from edgeq.worker.metrics import WorkerMetrics, serve_metrics
from edgeq.worker.notify import keep_watchdog, notify, watchdog_interval_s
from edgeq.worker.refill import RecentFinishes
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.state import WorkerState
from edgeq.worker.wire import dump_json, load_job

# The loop's timeout is a backstop behind the job's (which publishes a proper `timeout` event).
JOB_TIMEOUT_MARGIN_S = 10.0
# Leases are renewed this many times per lease TTL, so one late renewal is not a lost job.
LEASE_RENEWALS_PER_TTL = 4

log = structlog.get_logger("edgeq.worker")

#: The log event of each hand-over a keep-alive round made (the rest: ``job_lost``).
_HANDED_OVER_EVENTS = {
    Handover.CONTINUED: "job_handed_over",
    Handover.QUARANTINED: "job_quarantined",
}

#: Builds the worker's one engine from its settings: vLLM's (``ChatEngine.start``), or a
#: stand-in at a GPU's token rate for capacity runs (edgeq.bench.simulate).
EngineStarter = Callable[[WorkerSettings], Awaitable[Engine]]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_state(state: WorkerState) -> Literal["ready", "draining", "stalled"]:
    if state.draining.is_set():
        return "draining"
    return "stalled" if state.stalled_since is not None else "ready"


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
        state=worker_state(state),
        stalled_since=state.stalled_since,
        running=len(state.running.leased()),
        running_by_tenant=state.running.by_tenant(),
        adapters=state.adapters.names if state.adapters else [],
        adapters_refused=dict(state.adapters.refused if state.adapters else state.adapters_refused),
        max_jobs=settings.job_slots,
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
                redis, settings.queue, state.running.leased(), ttl_s=settings.lease_ttl_s
            )
            # Before any lease is judged: a finished job's lease that came back with Redis
            # is gone again before it could be taken for a lost worker's.
            await state.recent.refill_if_restarted(redis)
            handed = await reap_lost_jobs(
                redis,
                state.events,
                queue=settings.queue,
                max_continuations=settings.max_continuations,
                deadline_s=settings.continue_within_s,
                lease_ttl_s=settings.lease_ttl_s,
                dead_letter_ttl_s=settings.dead_letter_ttl_s,
                poison_refuse_s=settings.poison_refuse_s,
            )
            for job_id, outcome in handed.items():
                log.warning(
                    _HANDED_OVER_EVENTS.get(outcome, "job_lost"),
                    job_id=job_id,
                    reason="its worker's lease ran out",
                )
            await publish_heartbeat(
                redis, describe_worker(state, time.time()), ttl_s=settings.lease_ttl_s
            )
            state.metrics.waiting.set((await queue_depth(redis, settings.queue)).waiting)
            state.metrics.count_tenants(
                running=state.running.by_tenant(),
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
    are skipped: one then takes ~0.1 ms (~680k objects, 324-352 ms unfrozen, on a 2-vCPU
    machine, 2026-12-04). vLLM's own server and engine core do the same after their start-up."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def wanted_adapters(state: WorkerState) -> dict[str, str]:
    """The adapters this worker should hold: those registered for the queue, and its own
    (EDGEQ_ADAPTERS, which win a name both have)."""
    settings = state.settings
    return {**await adapter_registry(state.redis, settings.queue), **settings.adapters}


async def follow_adapter_registry(state: WorkerState, host: AdapterHost) -> None:
    """Each lease period (as the keep-alive round): load what ``edgeq adapters load`` added
    to the registry, unload what it took out."""
    period_s = state.settings.lease_ttl_s / LEASE_RENEWALS_PER_TTL
    while True:
        await asyncio.sleep(period_s)
        try:
            await host.sync(await wanted_adapters(state))
        except REDIS_ERRORS as error:
            log.warning("adapter_registry_unreadable", error=f"{type(error).__name__}: {error}")
        except Exception:  # the next round tries again; jobs go on with what is held
            log.exception("adapter_sync_failed")


#: Why a worker with LoRA off serves no registered adapter (``edgeq adapters load`` shows it).
LORA_OFF = (
    "LoRA is off on this worker: it started with no adapter set or registered and "
    "EDGEQ_ENABLE_LORA unset; restart it (or set EDGEQ_ENABLE_LORA=true)"
)


async def note_unservable_adapters(state: WorkerState) -> None:
    """Each lease period, on a worker with LoRA off: report every registered adapter as
    refused, with why, so ``edgeq adapters load`` and ``edgeq status`` say so."""
    period_s = state.settings.lease_ttl_s / LEASE_RENEWALS_PER_TTL
    while True:
        try:
            names = await adapter_registry(state.redis, state.settings.queue)
            state.adapters_refused = dict.fromkeys(names, LORA_OFF)
        except REDIS_ERRORS as error:
            log.warning("adapter_registry_unreadable", error=f"{type(error).__name__}: {error}")
        await asyncio.sleep(period_s)


async def start_adapters(state: WorkerState, engine: Engine) -> None:
    """Load the adapters this worker serves, and follow the registry, when LoRA is on."""
    llm = getattr(engine, "llm", None)  # vLLM's AsyncLLM; a stand-in engine has none
    if not state.settings.lora or llm is None:
        state.background.append(asyncio.create_task(note_unservable_adapters(state)))
        return
    settings = state.settings
    host = AdapterHost(llm, max_adapters=settings.max_adapters, max_rank=settings.max_adapter_rank)
    await host.sync(await wanted_adapters(state))
    state.adapters = host
    state.background.append(asyncio.create_task(follow_adapter_registry(state, host)))


async def start_engine(
    state: WorkerState,
    *,
    starter: EngineStarter = ChatEngine.start,
    resume_claims: Callable[[], None] = lambda: None,
) -> None:
    """Build and warm the engine before the first job is claimed; ``resume_claims``: what
    the liveness watch calls when a stalled engine steps again (the job loop's wake)."""
    settings = state.settings
    # First, so producers' enqueues apply this box's weights and caps while the engine builds.
    await publish_tenancy(state.redis, settings.queue, settings.tenancy)
    if settings.enable_lora is None and not settings.adapters:
        # Adapters registered for the queue turn LoRA on, so this worker serves them too.
        if await adapter_registry(state.redis, settings.queue):
            settings = state.settings = settings.model_copy(update={"enable_lora": True})
    began = time.monotonic()
    engine = await starter(settings)
    built = time.monotonic()
    await start_adapters(state, engine)
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
        max_jobs=settings.job_slots,
        device=state.device,
        adapters=state.adapters.names if state.adapters else None,
        metrics_port=settings.metrics_port or None,
        engine_build_s=round(built - began, 2),
        warmup_s=round(time.monotonic() - built, 3),
        gc_frozen_objects=frozen_objects,
        since_process_start_s=round(time.monotonic() - state.process_started, 2),
    )
    notify(f"READY=1\nSTATUS=warm, serving {settings.queue} with {settings.model}")
    start_watches(state, resume_claims)


def start_watches(state: WorkerState, resume_claims: Callable[[], None]) -> None:
    """The engine's liveness watch (worker/liveness.py) and systemd's watchdog pings, which
    stop while the engine is stalled."""
    if state.settings.engine_stall_s > 0:
        watch = watch_engine(state, worker_id=worker_id(), resume_claims=resume_claims)
        state.background.append(asyncio.create_task(watch))
    if (interval_s := watchdog_interval_s()) is not None:
        pings = keep_watchdog(interval_s, healthy=lambda: state.stalled_since is None)
        state.background.append(asyncio.create_task(pings))


async def stop_engine(state: WorkerState) -> None:
    background, state.background = state.background, []
    await cancel_and_wait(*background)  # the keep-alive round and the watchdog: sleep loops
    with contextlib.suppress(*REDIS_ERRORS):  # else its record expires within a lease
        await remove_worker(state.redis, state.settings.queue, worker_id())
    engine, state.engine = state.engine, None
    if engine is not None:  # seconds of waiting for its processes to exit: off the loop
        await asyncio.to_thread(engine.shutdown)
    log.info("worker_stopped", worker=worker_id())


def loop_config(settings: WorkerSettings) -> LoopConfig:
    # The claim keeps a job's in-progress mark and payload for as long as it may run.
    may_run_ms = int((settings.job_timeout_s + JOB_TIMEOUT_MARGIN_S) * 1000)
    return LoopConfig(
        queue=settings.queue,
        max_jobs=settings.job_slots,
        reserved_slots=settings.job_slots_reserved,
        poll_delay_s=settings.poll_delay_ms / 1000,
        lease_ttl_ms=int(settings.lease_ttl_s * 1000),
        in_progress_ttl_ms=may_run_ms,
        job_timeout_s=settings.job_timeout_s + JOB_TIMEOUT_MARGIN_S,
        # A start after the first continues the stream where it stopped (jobs.py).
        max_tries=settings.max_continuations + 1,
        keep_result_s=settings.keep_result_s,
        model=settings.model,
        abort_set=(
            cluster_abort_set_key(settings.queue)
            if is_cluster_url(settings.redis_url)
            else ARQ_ABORT_SET
        ),
    )


def build_worker(
    settings: WorkerSettings, *, process_started: float, metrics: WorkerMetrics
) -> tuple[WorkerState, JobLoop]:
    redis = make_redis(settings, job_serializer=dump_json, job_deserializer=load_job)
    events = EventLog(
        redis,
        replay_ttl_s=settings.replay_ttl_s,
        queue=settings.queue,
        usage_keep_s=settings.usage_keep_s,
    )
    state = WorkerState(
        settings=settings,
        redis=redis,
        events=events,
        metrics=metrics,
        recent=RecentFinishes(events, window_s=settings.refill_window_s),
        process_started=process_started,
        started_at=time.time(),
    )
    metrics.count_running(lambda: len(state.running.leased()))
    jobs = JobLoop(
        redis=redis,
        config=loop_config(settings),
        run_job=partial(chat, state),
        events=state.events,
        deserializer=load_job,
        serializer=dump_json,
        running=state.running,
        recent=state.recent,
        count_not_started=metrics.job_ended,
        may_claim=lambda: state.stalled_since is None and not state.engine_died,
    )
    return state, jobs


async def serve(
    settings: WorkerSettings,
    *,
    process_started: float,
    metrics: WorkerMetrics,
    engine_starter: EngineStarter = ChatEngine.start,
) -> int:
    """Serve until signalled; the exit code (EXIT_JOB_FAILED after the engine died)."""
    state, jobs = build_worker(settings, process_started=process_started, metrics=metrics)

    def on_drain() -> None:
        state.draining.set()
        log.info(
            "worker_draining", drain_timeout_s=settings.drain_timeout_s, running=len(jobs.running)
        )
        notify("STOPPING=1\nSTATUS=draining")

    log.info("worker_starting", worker=worker_id(), queue=settings.queue)
    try:
        await run_until_signalled(
            jobs,
            start=partial(start_engine, state, starter=engine_starter, resume_claims=jobs.wake),
            stop=partial(stop_engine, state),
            on_drain=on_drain,
            drain_timeout_s=settings.drain_timeout_s,
        )
    finally:
        await state.redis.aclose(close_connection_pool=True)
    return EXIT_JOB_FAILED if state.engine_died else EXIT_OK


def run_worker(
    settings: WorkerSettings,
    *,
    process_started: float,
    engine_starter: EngineStarter = ChatEngine.start,
) -> int:
    """Run until SIGINT/SIGTERM: stop taking jobs, let running chats finish for up to
    EDGEQ_DRAIN_TIMEOUT_S, end the rest with a `shutdown` error event. The exit code: 0, or
    EXIT_JOB_FAILED when the engine died (its supervisor restarts the worker on it)."""
    metrics = WorkerMetrics(tenants=settings.tenancy.named_tenants)
    if settings.metrics_port:
        serve_metrics(settings.metrics_host, settings.metrics_port)
    return asyncio.run(
        serve(
            settings,
            process_started=process_started,
            metrics=metrics,
            engine_starter=engine_starter,
        )
    )
