"""What the worker shares with every job it runs, as one typed object."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from edgeq.core.events import EventLog
from edgeq.worker.engine_api import Engine
from edgeq.worker.metrics import WorkerMetrics
from edgeq.worker.refill import RecentFinishes
from edgeq.worker.running import RunningJobs
from edgeq.worker.settings import WorkerSettings

if TYPE_CHECKING:  # imports vLLM
    from edgeq.worker.adapters import AdapterHost


@dataclass
class WorkerState:
    settings: WorkerSettings
    redis: Redis  # core/connection.make_redis's
    events: EventLog
    metrics: WorkerMetrics
    #: Jobs finished in the last EDGEQ_REFILL_WINDOW_S, to write again into a Redis that came
    #: back without them (worker/refill.py).
    recent: RecentFinishes
    #: time.monotonic() when the process started, and time.time() when the worker was built.
    process_started: float
    started_at: float
    #: The jobs running now, the job loop's own registry (worker/running.py): the leases of
    #: the ones served are renewed, their count reported.
    running: RunningJobs = field(default_factory=RunningJobs)
    #: Set on SIGTERM: jobs cut short by the drain end with ``shutdown``, not ``cancelled``.
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set once the engine is built and warm (app.start_engine); cleared on shutdown.
    engine: Engine | None = None
    device: str = ""
    #: The LoRA adapters the engine holds; None when LoRA is off (worker/adapters.py).
    adapters: AdapterHost | None = None
    #: With LoRA off: the registered adapters this worker cannot serve, with why.
    adapters_refused: dict[str, str] = field(default_factory=dict)
    background: list[asyncio.Task[None]] = field(default_factory=list)
    #: When the engine was found stalled (time.time()): it held work and made no step for
    #: EDGEQ_ENGINE_STALL_S (worker/liveness.py); None while it makes progress. No job is
    #: claimed meanwhile.
    stalled_since: float | None = None
    #: Set when a job met the engine dead: the worker then stops with EXIT_JOB_FAILED, not 0,
    #: or its supervisor (systemd's Restart=on-failure) would leave it down.
    engine_died: bool = False

    @property
    def ready_engine(self) -> Engine:
        if self.engine is None:  # jobs are claimed only after the start: a bug if seen
            raise RuntimeError("the engine is not started")
        return self.engine

