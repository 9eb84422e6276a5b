"""A hold on a real engine, for tests that act on a chat while it is still running: a vLLM
general plugin (entry point ``edgeq_test_engine_hold``) that makes the engine stop stepping
once a running request has produced a chosen number of tokens, until the test lets it go.

Why: a test that kills, freezes or restarts something "mid-answer" must know the answer cannot
end before the fault. Slowing the engine (``tests/helpers.slowed``) or suspending it once the
test has read a delta only makes that likely: on a loaded machine the test process itself may
not run for seconds while the engine goes on, and a 300-token answer of the tiny model takes
about 1.7 s (one such race failed `make test` on a clean clone). The hold is decided inside the
engine, before the step that would produce the next token, so it does not depend on how fast
anything is.

It does nothing unless ``EDGEQ_TEST_ENGINE_HOLD`` names a file path in the engine's
environment (a worker's engine processes inherit the worker's). While that file exists and holds
a number N, the engine's busy loop waits before each step in which some running request already
has N or more output tokens: the step that produced the Nth token has been sent on to the
worker, so N tokens reach the stream and no more. Deleting the file (``EngineHold.release``)
lets the engine go on; SIGKILL of the worker ends a held engine as any other (the edgeq plugin
makes the engine die with its worker).

    hold = EngineHold(tmp_path / "hold")        # in the worker's env: hold.env()
    hold.arm(after_tokens=1)
    ... submit, read the first delta: the engine now waits ...
    hold.release()
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

#: The file whose presence (and content, a token count) holds the engine.
HOLD_ENV = "EDGEQ_TEST_ENGINE_HOLD"
#: How often a held engine looks whether it was released.
POLL_S = 0.02


class EngineHold:
    """The test's side of the hold: one file per worker whose engine it should hold."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def env(self) -> dict[str, str]:
        """What to add to a worker's environment so that its engine obeys this hold."""
        return {HOLD_ENV: str(self.path)}

    def arm(self, *, after_tokens: int) -> None:
        """Hold the engine before any running request's token after the ``after_tokens``th."""
        if after_tokens < 1:
            raise ValueError("after_tokens must be at least 1")
        partial = self.path.with_suffix(".partial")
        partial.write_text(str(after_tokens))
        partial.replace(self.path)  # the engine never reads a half-written number

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def register() -> None:
    """vLLM calls this in each of its processes; only the engine core's busy loop is held."""
    path = os.environ.get(HOLD_ENV)
    if not path:
        return
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._process_engine_step
    if getattr(original, "_edgeq_held", False):
        return

    @functools.wraps(original)
    def step_unless_held(self: Any) -> bool:
        while _held_at(Path(path), self.scheduler):
            time.sleep(POLL_S)
        return original(self)

    step_unless_held._edgeq_held = True  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = step_unless_held


def _held_at(path: Path, scheduler: Any) -> bool:
    try:
        after_tokens = int(path.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return any(request.num_output_tokens >= after_tokens for request in scheduler.running)
