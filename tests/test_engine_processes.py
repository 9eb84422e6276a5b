"""vLLM's engine processes as the worker runs them: they yield the CPU to the worker."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

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


def test_an_engines_sockets_get_a_directory_of_their_own(
    monkeypatch: pytest.MonkeyPatch, short_tmp: Path
) -> None:
    from vllm import envs

    from edgeq.worker.engine import private_ipc_dir

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    # A worker killed before its engine's shutdown left its directory; a live one's stays.
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = short_tmp / f"edgeq-engine-{gone.pid}-abc123"
    alive = short_tmp / f"edgeq-engine-{os.getpid()}-def456"
    for left in (dead, alive):
        left.mkdir()
        (left / "socket").touch()
    # An engine built before in this process leaves vLLM's settings cached (ChatEngine.start):
    # the cache must not answer for the next engine's directory.
    envs.enable_envs_cache()
    with private_ipc_dir() as ipc_dir:
        assert ipc_dir is not None and Path(ipc_dir).parent == short_tmp
        assert Path(ipc_dir).name.startswith(f"edgeq-engine-{os.getpid()}-")
        assert not dead.exists() and alive.exists()
        assert envs.VLLM_RPC_BASE_PATH == ipc_dir  # what vLLM builds its socket paths from
    assert "VLLM_RPC_BASE_PATH" not in os.environ  # set only while the engine is built
    assert Path(ipc_dir).is_dir()  # left for the engine's shutdown to remove

    # A path too long for a socket address: vLLM's default, and no directory made.
    deep = short_tmp / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_ipc_dir() as ipc_dir:
        assert ipc_dir is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []

    # The operator's own path wins.
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/elsewhere")
    with private_ipc_dir() as ipc_dir:
        assert ipc_dir is None and os.environ["VLLM_RPC_BASE_PATH"] == "/run/elsewhere"
