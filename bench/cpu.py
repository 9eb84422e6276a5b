"""CPU time of the processes a benchmark runs, read from /proc (Linux).

On a box whose engine is CPU-bound (every CPU-only machine) whatever the queue's processes use
is taken from the engine, so a run says where the CPU went as well as how long things took.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence

#: The process that holds the engine's front end (AsyncLLM: output processing, detokenizing)
#: and, in a queue mode, all of edgeq's work per token: the worker's own process, or the bench
#: process itself for --direct.
FRONT = "front"
#: The roles a run's CPU per token is reported for, in the order the tables show them.
CPU_ROLES = (FRONT, "engine", "redis", "client")
US_PER_S = 1e6


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system); raises OSError once it is gone."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s_by_role(pids: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds used so far by each role's processes (a process that ended counts 0)."""
    totals: dict[str, float] = {}
    for role, role_pids in pids.items():
        total = 0.0
        for pid in role_pids:
            with contextlib.suppress(OSError):
                total += process_cpu_s(pid)
        totals[role] = total
    return totals


def cpu_us_per_token(
    cpu_s: Mapping[str, float], client_cpu_s: float, output_tokens: int, *, in_process: bool
) -> dict[str, float]:
    """CPU µs per generated token of each role of a run: ``front`` (the worker's own process,
    or for an engine in the bench's process that process), ``engine`` (vLLM's engine-core
    processes), ``redis`` and ``client`` (the bench process, when it is not the front).

    ``cpu_s`` holds the seconds by role a run measured (``worker``, ``engine``, ``redis``);
    ``in_process``: the engine's front end ran in the bench process (``--direct``).
    """
    if output_tokens <= 0:
        return {}
    seconds = dict(cpu_s)
    if in_process:
        seconds[FRONT] = client_cpu_s
    else:
        if "worker" in seconds:
            seconds[FRONT] = seconds.pop("worker")
        seconds["client"] = client_cpu_s
    return {role: US_PER_S * value / output_tokens for role, value in seconds.items()}
