"""vLLM's engine processes of a worker: found among its descendants by name, and waited for
until they are gone (read from /proc, Linux; no vLLM import, so bench and tests use it too)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: vLLM names its engine processes so (``VLLM::EngineCore``, ``VLLM::Worker``).
ENGINE_PROCESS_PREFIX = "VLLM::"
#: How often a wait for processes to end looks again.
EXIT_POLL_S = 0.05


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (state) on; None once the pid is free."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def engine_pids(parent: int, *, own: bool = False) -> list[int]:
    """vLLM's engine processes among ``parent``'s descendants. ``own``: only the engine that
    ``parent`` runs itself (its ``VLLM::`` children and theirs), not those of other programs
    it started (a test's workers, each with its engine)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        # A process that ended while we looked has no stat.
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(parent, ()))
    while todo:
        pid = todo.pop()
        try:
            engine = Path(f"/proc/{pid}/comm").read_text().startswith(ENGINE_PROCESS_PREFIX)
        except OSError:
            continue
        if engine:
            found.append(pid)
        if engine or not own:
            todo.extend(children.get(pid, ()))
    return sorted(found)


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from a later one that gets the same pid once it has ended."""

    pid: int
    started: int  # clock ticks after boot at which it started (/proc/PID/stat, field 22)


def identify(pids: Iterable[int]) -> list[ProcessId]:
    """The processes now running under these pids (those already gone are left out)."""
    return [ProcessId(pid, int(stat[19])) for pid in pids if (stat := _stat(pid)) is not None]


def _running(process: ProcessId) -> bool:
    """Still holding its memory: present and not a zombie (a zombie waits only to be reaped)."""
    stat = _stat(process.pid)
    return stat is not None and int(stat[19]) == process.started and stat[0] not in ("Z", "X")


def wait_until_gone(processes: Iterable[ProcessId], timeout_s: float) -> list[ProcessId]:
    """Wait up to ``timeout_s`` for the processes to end; those still running after it."""
    left = [process for process in processes if _running(process)]
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(EXIT_POLL_S)
        left = [process for process in left if _running(process)]
    return left


def kill_and_wait(processes: Iterable[ProcessId], timeout_s: float) -> list[ProcessId]:
    """SIGKILL the processes still running, then wait for them as ``wait_until_gone``."""
    running = [process for process in processes if _running(process)]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    return wait_until_gone(running, timeout_s)
