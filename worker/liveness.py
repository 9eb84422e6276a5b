"""Liveness by progress: a worker whose engine holds work and makes no step is stalled.

A worker's heartbeat, leases and systemd watchdog are fed by its event loop, which runs on
when only the engine's processes are stuck (a hung GPU, a stuck collective, a frozen
``VLLM::EngineCore``): the worker then looked ``ready`` and went on claiming chats into an
engine that never answered them (#41). So the worker also watches the engine's steps:

- **A step** is what vLLM's engine reports after each scheduler iteration: with stats on (the
  worker always has them) every step sends its scheduler stats to the worker's process, and
  a stat logger (worker/engine.py, ``StepSignal``) notes the time. A long chunked prefill
  yields no output for its request until its first token, but it is one step per chunk, so it
  is progress; a request's outputs alone would not show it. An idle engine makes no steps and
  is never stalled: the clock starts when work comes to an idle engine (``StepWatch``).
- **Stalled**: the engine held work and made no step for ``EDGEQ_ENGINE_STALL_S``. The worker
  then takes no new jobs, says ``stalled`` (and since when) in its heartbeat, so in
  ``edgeq status`` and the gateway's ``/ready``, stops feeding the systemd watchdog, and
  counts it (``edgeq:engine_stalls``). Its running jobs keep their leases: should the engine
  make a step again, the stall is over and nothing was lost.
- **Ended**: stalled for ``EDGEQ_ENGINE_STALL_EXIT_S`` more, the worker lets its jobs'
  leases run out at once (another worker's next keep-alive round continues them, as after a
  crash: core/leases.py), kills the engine's processes and exits with
  ``EXIT_ENGINE_STALLED`` without publishing anything for its jobs, so that its supervisor
  starts a fresh one. The stall is counted on each of those jobs first: one running at a
  second engine failure is quarantined instead of continued (a poison job, core/leases.py).

A check that wakes up late (the event loop itself was held up) judges nothing: the engine's
outputs may be waiting unread behind the same hold-up, and a stuck loop is the systemd
watchdog's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable

import structlog

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.leases import hand_over_after_engine_failure
from edgeq.core.registry import remove_worker
from edgeq.exit_codes import EXIT_ENGINE_STALLED
from edgeq.worker.notify import notify
from edgeq.worker.state import WorkerState

# The stall is looked for this many times per EDGEQ_ENGINE_STALL_S, at most once a second.
CHECKS_PER_STALL = 4
MAX_CHECK_S = 1.0
# The Redis steps of a stalled worker's end get this long: it ends either way.
EXIT_REDIS_TIMEOUT_S = 2.0

log = structlog.get_logger("edgeq.worker")


class StepWatch:
    """When the engine last made progress: its last step, or work coming to it while idle."""

    def __init__(self) -> None:
        self._last_s = time.monotonic()

    def stepped(self) -> None:
        self._last_s = time.monotonic()

    def work_added(self, *, idle: bool) -> None:
        """A request is being added; ``idle``: the engine held none before it."""
        if idle:  # an idle engine makes no steps: its quiet time counts from now
            self._last_s = time.monotonic()

    def without_step_s(self, *, busy: bool) -> float:
        """Seconds of holding work with no step since (0 when the engine holds none)."""
        return time.monotonic() - self._last_s if busy else 0.0


def check_period_s(stall_s: float) -> float:
    return min(MAX_CHECK_S, stall_s / CHECKS_PER_STALL)


async def watch_engine(
    state: WorkerState, *, worker_id: str, resume_claims: Callable[[], None]
) -> None:
    """Run for the worker's life: mark the worker stalled, recovered, or end it."""
    settings = state.settings
    period_s = check_period_s(settings.engine_stall_s)
    stalled_at: float | None = None  # time.monotonic() of the stall
    while True:
        due_s = time.monotonic() + period_s
        await asyncio.sleep(period_s)
        if time.monotonic() - due_s > period_s:
            continue  # the loop itself was held up: the engine's outputs may wait behind it
        quiet_s = state.ready_engine.without_step_s()
        if quiet_s < settings.engine_stall_s:
            if stalled_at is not None:
                stalled_at = None
                recovered(state)
                resume_claims()
        elif stalled_at is None:
            stalled_at = time.monotonic()
            stalled(state, quiet_s)
        elif time.monotonic() - stalled_at >= settings.engine_stall_exit_s:
            await end_stalled_worker(state, worker_id=worker_id)


def stalled(state: WorkerState, quiet_s: float) -> None:
    state.stalled_since = time.time()
    state.metrics.engine_stalls.inc()
    log.error(
        "engine_stalled",
        no_step_s=round(quiet_s, 1),
        running=len(state.running.leased()),
        engine_unfinished_requests=state.ready_engine.unfinished_requests(),
        action=f"no new jobs; exiting in {state.settings.engine_stall_exit_s:g} s "
        "unless the engine makes a step",
    )
    notify(f"STATUS=stalled: the engine made no step for {quiet_s:.0f} s; taking no jobs")


def recovered(state: WorkerState) -> None:
    since, state.stalled_since = state.stalled_since, None
    log.warning("engine_recovered", stalled_s=round(time.time() - (since or time.time()), 1))
    notify(f"STATUS=warm, serving {state.settings.queue} with {state.settings.model}")


async def end_stalled_worker(state: WorkerState, *, worker_id: str) -> None:
    """Hand the running jobs over, kill the engine, exit with EXIT_ENGINE_STALLED. Nothing is
    published for the jobs: their leases' expiry continues them elsewhere."""
    settings = state.settings
    log.error(
        "worker_ending_stalled",
        stalled_s=round(time.time() - (state.stalled_since or time.time()), 1),
        running=len(state.running.leased()),
        exit_code=EXIT_ENGINE_STALLED,
    )
    notify("STATUS=ending: the engine stalled; its jobs are handed over")
    with contextlib.suppress(*REDIS_ERRORS, TimeoutError):
        async with asyncio.timeout(EXIT_REDIS_TIMEOUT_S):
            # A job at its second engine failure is quarantined, not continued (a poison
            # job, core/leases.py).
            served = state.running.leased()
            await hand_over_after_engine_failure(state.redis, settings.queue, served)
            await remove_worker(state.redis, settings.queue, worker_id)
    # Blocking the event loop on purpose, from here to the exit: once the engine is gone its
    # jobs would see it dead and end with `engine_error` (and the worker drain, which ends the
    # rest with `shutdown`), where they are to be continued.
    if state.engine is not None:
        state.engine.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_ENGINE_STALLED)
