"""CPU time of the processes a benchmark runs, read from /proc (Linux).

On a box whose engine is CPU-bound (every CPU-only machine) whatever the queue's processes use
is taken from the engine, so a run says where the CPU went as well as how long things took.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence


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
