"""vLLM's engine processes of a worker: found among its descendants by name, and waited for
until they are gone (read from /proc, Linux; no vLLM import, so bench and tests use it too)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

#: vLLM names its engine processes so (``VLLM::EngineCore``, ``VLLM::Worker``).
ENGINE_PROCESS_PREFIX = "VLLM::"
#: How often a wait for processes to end looks again.
EXIT_POLL_S = 0.05


def engine_pids(parent: int) -> list[int]:
    """vLLM's engine processes among ``parent``'s descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # a process that ended while we looked
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(parent, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith(ENGINE_PROCESS_PREFIX):
                found.append(pid)
    return sorted(found)


def _running(pid: int) -> bool:
    """Still holding its memory: present and not a zombie (a zombie waits only to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_until_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for the processes to end; those still running after it."""
    left = [pid for pid in pids if _running(pid)]
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(EXIT_POLL_S)
        left = [pid for pid in left if _running(pid)]
    return left


def kill_and_wait(pids: Iterable[int], timeout_s: float) -> list[int]:
    """SIGKILL the processes, then wait for them as ``wait_until_gone``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return wait_until_gone(pids, timeout_s)
