"""``edgeq capacity --redis-ceiling``: edgeq's publish script driven from C, a few thousand
events, Redis only."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgeq.bench.redis_ceiling import run_redis_ceiling_command


def test_both_modes_are_measured_and_written(tmp_path: Path) -> None:
    if shutil.which("redis-benchmark") is None:
        pytest.fail("redis-benchmark is missing: scripts/install-system-deps.sh installs it")
    out = tmp_path / "ceiling.json"
    finished = subprocess.run(
        [
            *(sys.executable, "-m", "edgeq", "capacity", "--redis-ceiling"),
            *("--rounds", "1", "--events", "3000", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finished.returncode == 0, finished.stderr
    table = finished.stdout.splitlines()
    assert table[:3] == [
        "256 jobs, 8 connections, 3,000 events per mode and round",
        "mode | events/s | Redis CPU µs/event",
        "--- | --- | ---",
    ]
    assert [line.split(" | ")[0] for line in table[3:]] == ["pipelined", "unpipelined"]
    assert re.search(r"round 1 unpipelined: [\d,]+ events/s", finished.stderr)
    written = json.loads(out.read_text())
    assert written["events"] == 3000
    for mode in ("pipelined", "unpipelined"):
        (row,) = written["modes"][mode]
        # Every call was a PUBLISH through the script, and each cost Redis some CPU.
        assert row["events_per_s"] > 0
        assert 0 < row["redis_cpu_us_per_event"] < 10_000


def test_without_redis_tools_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    args = argparse.Namespace(rounds=1, events=10, out=None)
    assert run_redis_ceiling_command(args) == 1
    assert "apt-get install redis-tools" in capsys.readouterr().err
