"""`edgeq tune`: a tiny real sweep (two workers on the tiny model), and the rules it ranks and
skips by, checked without an engine (a configuration WorkerSettings refuses never starts one)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from edgeq.bench.metrics import calculate_metrics
from edgeq.bench.records import ModeRun, RequestRecord
from edgeq.bench.runners import ModePlan
from edgeq.bench.tune import (
    TuneConfig,
    TuneResult,
    format_tune_table,
    pick_best,
    run_sweep,
    start_failure,
    sweep_configs,
)
from edgeq.cli import build_parser
from edgeq.core.settings import load_settings
from edgeq.worker.settings import WorkerSettings
from helpers import EDGEQ, TEST_MAX_MODEL_LEN

pytestmark = pytest.mark.engine

# Each configuration starts a worker (~20 s on two cores): two configurations, a tiny workload.
USERS = 4
INPUT_LEN_MIN, INPUT_LEN_MAX = 24, 48  # the tiny model's template alone is 19 tokens
MAX_TOKENS = 8
BUDGET = TEST_MAX_MODEL_LEN
CLI_TIMEOUT_S = 400
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLOS = {"ttft": 500.0, "e2el": 3000.0}
CONFIG = {
    "model": "tiny",
    "users": 2,
    "num_prompts": 2,
    "input_len_min": 24,
    "input_len_max": 48,
    "max_tokens": 8,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 0,
    "goodput_slos_ms": SLOS,
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("EDGEQ_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no stray .env


def records(e2el_s: list[float], tokens: int) -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i, user=i, success=True, start_s=0, ttft_s=0.05, e2el_s=e2el, output_tokens=tokens
        )
        for i, e2el in enumerate(e2el_s)
    ]


def measured(config: TuneConfig, e2el_s: list[float], tokens: int) -> TuneResult:
    return TuneResult(config, metrics=calculate_metrics(records(e2el_s, tokens), 1.0, SLOS))


# --- fast: no engine ------------------------------------------------------------------------


def test_the_best_has_the_highest_goodput_then_the_most_tokens() -> None:
    a, b, c, d = (TuneConfig(seqs, 512, True) for seqs in (8, 16, 32, 64))
    # a: 2 good requests, many tokens; b: 3 good, few tokens; c: 3 good, more tokens; d: failed.
    results = [
        measured(a, [0.1, 0.1, 9.0, 9.0], tokens=100),
        measured(b, [0.1, 0.1, 0.1], tokens=5),
        measured(c, [0.1, 0.1, 0.1], tokens=6),
        TuneResult(d, error="invalid: no"),
    ]
    assert pick_best(results) is results[2]
    assert pick_best(results[:2]) is results[1]  # goodput beats tok/s
    assert pick_best([results[3]]) is None


def test_an_invalid_configuration_is_reported_and_the_sweep_goes_on() -> None:
    refused = TuneConfig(64, 32, True)  # WorkerSettings: budget below the batch
    not_started = TuneConfig(8, 256, False)  # vLLM: chunked prefill off, budget below context
    good = TuneConfig(8, 512, True)
    started: list[str] = []

    def fake_run_plan(plan: ModePlan, workload: Any, users: int, **_: Any) -> ModeRun:
        started.append(plan.name)
        assert plan.worker_env is not None
        if plan.worker_env["EDGEQ_ENABLE_CHUNKED_PREFILL"] == "false":
            return ModeRun(
                name=plan.name,
                target="queue",
                error="WorkerFailed: the worker exited before it was ready:\nINFO a vLLM line\n"
                "edgeq worker: stopped: ValueError: max_num_batched_tokens (256) is smaller "
                "than max_model_len (512).",
            )
        return ModeRun(
            name=plan.name, target="queue", duration_s=1.0, records=records([0.1, 0.2], 8)
        )

    results = run_sweep(
        [refused, not_started, good],
        workload=None,  # type: ignore[arg-type]  # the fake runner never reads it
        users=2,
        slos_ms=SLOS,
        model="tiny",
        count_tokens=len,
        log_dir=Path("logs"),
        runner=fake_run_plan,
    )

    assert started == [not_started.name, good.name]  # the refused one never starts a worker
    assert [r.config for r in results] == [refused, not_started, good]
    assert results[0].error is not None and results[0].error.startswith("invalid: ")
    assert "EDGEQ_MAX_NUM_BATCHED_TOKENS must be at least" in results[0].error
    assert results[1].error == (
        "invalid: ValueError: max_num_batched_tokens (256) is smaller than max_model_len (512)."
    )
    assert results[2].metrics is not None and results[2].metrics.completed == 2
    best = pick_best(results)
    assert best is results[2]
    table = format_tune_table(CONFIG, results, best)
    assert table.count("invalid: ") == 2
    assert re.search(r"^\*\s+8\s+512\s+on\s", table, re.MULTILINE)


def test_start_failure_tells_a_worker_that_did_not_start_from_other_errors() -> None:
    assert start_failure("RuntimeError: warm-up failed") is None
    assert start_failure("WorkerFailed: the worker exited before it was ready:\nboom") == "boom"
    pydantic = (
        "WorkerFailed: the worker exited before it was ready:\nedgeq worker: stopped: "
        "ValidationError: 1 validation error for SchedulerConfig\n  Value error, too small [x]"
    )
    assert start_failure(pydantic) == "too small [x]"


def test_sweep_configs_and_the_parser() -> None:
    args = build_parser().parse_args(
        ["tune", "--max-num-seqs", "8,16", "--chunked-prefill", "off", "--block-size", "64,128"]
    )
    assert args.max_num_seqs == [8, 16] and args.chunked_prefill == [False]
    configs = sweep_configs(args.max_num_seqs, [512], args.chunked_prefill, args.block_size)
    assert len(configs) == 4
    assert configs[0].env() == {
        "EDGEQ_MAX_NUM_SEQS": "8",
        "EDGEQ_MAX_NUM_BATCHED_TOKENS": "512",
        "EDGEQ_ENABLE_CHUNKED_PREFILL": "false",
        "EDGEQ_BLOCK_SIZE": "64",
    }
    assert "EDGEQ_BLOCK_SIZE" not in TuneConfig(8, 512, True).env()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--chunked-prefill", "maybe"])


# --- a real sweep ---------------------------------------------------------------------------


def test_a_tiny_sweep_writes_the_winner_and_a_plot(
    tiny_model: Path, tmp_path: Path, short_tmp: Path
) -> None:
    out, plot = tmp_path / "tuned.env", tmp_path / "tune.png"
    env = {name: value for name, value in os.environ.items() if not name.startswith("EDGEQ_")}
    env |= {
        "HF_HUB_OFFLINE": "1",
        "EDGEQ_CPU_KV_CACHE_GIB": "1",
        "EDGEQ_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "TMPDIR": str(short_tmp),  # where tune keeps its workers' logs: gone with the test
    }
    completed = subprocess.run(
        [
            *EDGEQ,
            "tune",
            *("--max-num-seqs", "8,16", "--max-num-batched-tokens", str(BUDGET)),
            *("--chunked-prefill", "on", "--users", str(USERS)),
            *("--input-len-min", str(INPUT_LEN_MIN), "--input-len-max", str(INPUT_LEN_MAX)),
            *("--max-tokens", str(MAX_TOKENS), "--slo", "ttft:60000", "e2el:60000"),
            *("--model", str(tiny_model), "--out", str(out), "--plot", str(plot)),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    rows = {
        int(match.group(2)): match.group(1) == "*"
        for match in re.finditer(
            rf"^(\*?)\s+(\d+)\s+{BUDGET}\s+on\s+-\s+[\d.]+\s+[\d.]+", completed.stdout, re.MULTILINE
        )
    }
    assert set(rows) == {8, 16}, completed.stdout
    [winner] = [seqs for seqs, best in rows.items() if best]

    text = out.read_text()
    assert text.startswith("# edgeq tune")
    assert f"EDGEQ_MAX_NUM_SEQS={winner}\n" in text
    settings = load_settings(WorkerSettings, env_file=out)
    assert settings.max_num_seqs == winner
    assert settings.max_num_batched_tokens == BUDGET
    assert settings.enable_chunked_prefill is True
    # What was in force while measuring goes with it.
    assert settings.max_model_len == TEST_MAX_MODEL_LEN
    assert settings.model == str(tiny_model)
    assert plot.read_bytes().startswith(PNG_MAGIC)
