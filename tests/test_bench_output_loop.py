"""``python -m edgeq.bench.output_loop``, the worker job loop's CPU per output that
docs/performance.md states, still runs the real loop and prints its figure."""

from __future__ import annotations

import re
import subprocess
import sys

from edgeq.bench.output_loop import measure


def test_each_round_measures_some_cpu_per_output() -> None:
    rounds = measure(jobs_=3, tokens=20, rounds=2)
    assert len(rounds) == 2
    # Every output costs the loop something, and far less than a millisecond.
    assert all(0 <= us < 1000 for us in rounds)


def test_the_documented_command_prints_its_figure() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "edgeq.bench.output_loop", "--jobs", "3", "--tokens", "20",
         "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout  # fmt: skip
    assert re.search(
        r"worker job loop: \d+\.\d\d \[\d+\.\d\d-\d+\.\d\d\] CPU µs per output over "
        r"2 rounds of 3 jobs x 20 outputs",
        printed,
    )
