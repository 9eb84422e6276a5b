"""vLLM's engine processes as the worker runs them: they yield the CPU to the worker."""

from __future__ import annotations

import os

import pytest

from edgeq.testing.processes import WorkerProcess
from edgeq.worker.settings import WorkerSettings
from helpers import engine_of

pytestmark = pytest.mark.engine


def engine_threads(worker: WorkerProcess) -> dict[str, list[int]]:
    """The niceness of every thread of each of the worker's vLLM processes, by process name."""
    niceness: dict[str, list[int]] = {}
    for process in engine_of(worker):
        for thread in process.threads():
            niceness.setdefault(process.name(), []).append(
                os.getpriority(os.PRIO_PROCESS, thread.id)
            )
    return niceness


def test_every_engine_thread_runs_engine_nice_steps_below_the_worker(
    worker: WorkerProcess,
) -> None:
    # The engine's busy threads share the cores with the worker's event loop; at a lower
    # priority they cannot keep it waiting for a core on the path to a first token.
    steps = int(
        worker.env.get("EDGEQ_ENGINE_NICE", WorkerSettings.model_fields["engine_nice"].default)
    )
    assert steps > 0
    worker_nice = os.getpriority(os.PRIO_PROCESS, worker.process.pid)
    niceness = engine_threads(worker)
    assert niceness, "no vLLM engine process found under the worker"
    for name, threads in niceness.items():
        # Every thread, also those vLLM started before its plugins loaded and those torch
        # started later; a process spawned by another engine process is not lowered twice.
        assert set(threads) == {worker_nice + steps}, (name, threads)
