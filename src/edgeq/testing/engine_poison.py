"""A poison request for a real engine, for tests of quarantine (#41): a vLLM general plugin
(entry point ``edgeq_test_engine_poison``) that makes the engine core die as soon as it is
about to step a request built for it, as a request that crashes vLLM (a grammar bug, a kernel
fault) would.

It does nothing unless ``EDGEQ_TEST_ENGINE_POISON`` holds a sampling seed in the engine's
environment (a worker's engine processes inherit the worker's). Then a request whose ``seed`` is
that number is the poison: before each step, the engine core process exits at once
(``os._exit``, no clean-up, as a crash) if such a request is waiting or running. Every other
request is served as usual, so the chats that shared the engine with it die with it, and a
healthy chat on a restarted engine is answered.

The seed is the marker because it reaches the engine core unchanged on every start of the job
(a continued job keeps its request), and no text or token id has to be matched.

    env = {POISON_ENV: str(POISON_SEED)}       # in the worker's environment
    await client.submit("anything", seed=POISON_SEED)   # kills the engine that steps it
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: The sampling seed that marks the poison request.
POISON_ENV = "EDGEQ_TEST_ENGINE_POISON"
#: A seed no other test asks for.
POISON_SEED = 4_141_414
#: How the engine core ends: as a crash, not a clean exit.
POISON_EXIT_CODE = 86


def register() -> None:
    """vLLM calls this in each of its processes; only the engine core's busy loop dies."""
    marker = os.environ.get(POISON_ENV)
    if not marker:
        return
    seed = int(marker)
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._process_engine_step
    if getattr(original, "_edgeq_poisoned", False):
        return

    @functools.wraps(original)
    def step_unless_poisoned(self: Any) -> bool:
        if _holds_seed(self.scheduler, seed):
            os._exit(POISON_EXIT_CODE)
        return original(self)

    step_unless_poisoned._edgeq_poisoned = True  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = step_unless_poisoned


def _holds_seed(scheduler: Any, seed: int) -> bool:
    requests = [*scheduler.waiting, *scheduler.running]
    return any(getattr(request.sampling_params, "seed", None) == seed for request in requests)
