"""What the worker shares with every job it runs, as one typed object.

arq hands each job a copy of the worker's ``ctx`` dict (plus ``job_id``, ``enqueue_time`` and
the like); edgeq keeps its own state in one entry of it, so jobs read attributes that a type
checker knows instead of a dozen string keys re-annotated at each read.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arq.connections import ArqRedis

from edgeq.core.events import EventLog
from edgeq.worker.metrics import WorkerMetrics
from edgeq.worker.settings import WorkerSettings

if TYPE_CHECKING:  # the engine module imports vLLM; the state only holds one
    from edgeq.worker.engine import ChatEngine

#: The key of the worker's state in arq's ctx.
STATE_KEY = "edgeq"


@dataclass
class WorkerState:
    settings: WorkerSettings
    redis: ArqRedis
    events: EventLog
    metrics: WorkerMetrics
    #: time.monotonic() when the process started, and time.time() when the worker was built.
    process_started: float
    started_at: float
    #: The jobs running now (id -> tenant): their leases are renewed, their count reported.
    running: dict[str, str] = field(default_factory=dict)
    #: Jobs whose stream another run of them took (this worker was thought dead and the job
    #: was handed over): their keys are that run's to clean up, not this one's.
    superseded: set[str] = field(default_factory=set)
    #: Set on SIGTERM: jobs cut short by the drain end with ``shutdown``, not ``cancelled``.
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by arq's on_startup once the engine is built and warm; cleared on shutdown.
    engine: ChatEngine | None = None
    device: str = ""
    background: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def ready_engine(self) -> ChatEngine:
        if self.engine is None:  # arq runs jobs only after on_startup: a bug if seen
            raise RuntimeError("the engine is not started")
        return self.engine


def running_by_tenant(state: WorkerState) -> dict[str, int]:
    return dict(Counter(state.running.values()))


def worker_state(ctx: Mapping[str, Any]) -> WorkerState:
    state: WorkerState = ctx[STATE_KEY]
    return state
