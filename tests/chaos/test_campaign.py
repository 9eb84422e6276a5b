"""A short chaos campaign (``edgeq chaos``, docs/development.md "Chaos campaign"): two workers
on the tiny model under the harness's restarting supervisor, eight chats in flight, and one of
each fault kind of a fixed seed's schedule, a poison request among them (#41: quarantined
after two engine deaths, then refused at the door). Every accepted job must be accounted
for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeq.testing.chaos import FAULT_KINDS, fault_schedule
from helpers import FIGURES, TEST_MAX_MODEL_LEN, TEST_MAX_NUM_BATCHED_TOKENS

pytestmark = pytest.mark.engine

SEED = 34
DURATION_S = 90
# Start-up (two engines side by side), 90 s of load, the drain and the stops: 3.5-5 min here
# (the poison fault leaves no worker serving until both are started again).
CAMPAIGN_TIMEOUT_S = 540
KINDS = [kind for kind in FAULT_KINDS if kind != "kill_gateway"] + ["poison"]


def test_a_short_campaign_accounts_for_every_job(tiny_model: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    env = {
        **os.environ,
        # Sized for two engines on two cores (tests/helpers.py engine_env).
        "EDGEQ_CPU_KV_CACHE_GIB": "1",
        "EDGEQ_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "EDGEQ_MAX_NUM_BATCHED_TOKENS": str(TEST_MAX_NUM_BATCHED_TOKENS),
    }
    started = time.monotonic()
    # Its own process: the harness cleans up after itself however it ends, and a test
    # timeout that kills it leaves the test's own process clean.
    run = subprocess.run(
        [sys.executable, "-m", "edgeq", "chaos", "--duration", str(DURATION_S),
         "--seed", str(SEED), "--model", str(tiny_model), "--workdir", str(tmp_path / "run"),
         "--faults", ",".join(KINDS), "--out", str(report_path)],
        env=env, capture_output=True, text=True, timeout=CAMPAIGN_TIMEOUT_S,
    )  # fmt: skip
    wall_s = time.monotonic() - started
    print(run.stdout)
    assert report_path.exists(), f"no report (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    report = json.loads(report_path.read_text())
    assert report["problems"] == [], run.stdout
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    planned = [fault.kind for fault in fault_schedule(SEED, DURATION_S, KINDS)]
    assert set(planned) == set(KINDS)
    assert [fault["kind"] for fault in report["faults"]] == planned
    assert report["skipped_faults"] == []
    assert report["accepted"] > 50 and report["done"] > 0
    # The poison request (its checks are the campaign's: a problem if one failed).
    (poison,) = [fault for fault in report["faults"] if fault["kind"] == "poison"]
    assert "ended poison_job" in poison["detail"] and "refused at the door" in poison["detail"]
    assert report["by_kind"]["poison"] == 1 and report["failed"].get("poison_job") == 1
    FIGURES[f"chaos campaign, seed {SEED}, {DURATION_S} s of load: wall (s)"] = round(wall_s)
    FIGURES["chaos campaign: accepted / done / continued / cancelled / refused / problems"] = (
        f"{report['accepted']} / {report['done']} / {report['continued']} / "
        f"{report['cancelled']} / {sum(report['refused'].values())} / {len(report['problems'])}"
    )
    FIGURES["chaos campaign: the poison request"] = poison["detail"]
    FIGURES["chaos campaign: chats quarantined with the poison request (bystanders)"] = len(
        report["quarantined_bystanders"]
    )
    FIGURES["chaos campaign: TTFT p50 / p99 (ms), outside / inside faults"] = " ; ".join(
        f"{t['p50']:.0f} / {t['p99']:.0f}"
        for t in (report["ttft_ms"]["outside faults"], report["ttft_ms"]["inside faults"])
    )
