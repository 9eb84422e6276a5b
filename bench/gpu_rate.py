"""How fast a simulated GPU makes tokens (edgeq.bench.simulate), kept apart from the stand-in
engine so that the commands that only name a rate (``edgeq bench``, ``edgeq capacity``) do not
import the engine's code, and vLLM with it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edgeq.testing.processes import WorkerProcess


@dataclass(frozen=True)
class GpuRate:
    """How fast the simulated GPU makes tokens. The defaults plan Qwen3-0.6B on one modern
    GPU with a full batch (not measured here: no GPU)."""

    step_ms: float = 30.0  # one decode step for every running request
    prefill_ms: float = 30.0  # request added → its first token

    def describe(self) -> str:
        return f"simulated GPU ({self.step_ms:g} ms/step, first token after {self.prefill_ms:g} ms)"

    def box_args(self) -> tuple[str, ...]:
        """The ``edgeq simulate-box`` options for this rate."""
        return ("--step-ms", f"{self.step_ms:g}", "--prefill-ms", f"{self.prefill_ms:g}")


def worker_process(env: Mapping[str, str], log_path: Path, gpu: GpuRate | None) -> WorkerProcess:
    """``edgeq worker`` with ``env``; with ``gpu``, ``edgeq simulate-box`` at its rate. Not
    started yet."""
    if gpu is None:
        return WorkerProcess(env, log_path)
    return WorkerProcess(env, log_path, command="simulate-box", args=gpu.box_args())
