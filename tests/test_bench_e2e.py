"""`edgeq bench` end to end on real parts: through the shared worker (Redis, arq, the engine
process, pub/sub) and straight on an engine built in this process, both on the tiny model."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from edgeq.bench.metrics import calculate_metrics
from edgeq.bench.records import ModeRun
from edgeq.bench.runners import run_target, run_users
from edgeq.bench.targets import ChunkClock, DirectTarget, Outcome, QueueTarget
from edgeq.bench.workload import (
    BenchRequest,
    Workload,
    WorkloadSpec,
    build_workload,
    load_tokenizer,
)
from edgeq.core.settings import ConnectionSettings, load_settings
from edgeq.exit_codes import EXIT_INTERRUPTED
from edgeq.testing.processes import WorkerProcess
from edgeq.worker.engine_processes import engine_pids
from edgeq.worker.settings import WorkerSettings
from helpers import EDGEQ, TEST_MAX_MODEL_LEN

pytestmark = pytest.mark.engine

USERS = 4
REQUESTS_PER_USER = 2
# The tiny model's chat template alone is 19 tokens, so its shortest prompt is 20.
INPUT_LEN_MIN = 24
INPUT_LEN_MAX = 48
MAX_TOKENS = 16
# EDGEQ_STREAM_TOKENS of the in-process engine: tokens per engine output after the first.
STREAM_TOKENS = 3
SEED = 7
# Roomy: the CLI imports transformers and matplotlib before the first request.
CLI_TIMEOUT_S = 180
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# After the bench starts its worker: it is importing and building its engine.
WORKER_STARTING_S = 3
# A worker stopped during its engine's start-up, its engine processes and Redis.
STOPPED_WITHIN_S = 30
# Rounding of sums of float gaps, in seconds.
CLOCK_SLACK_S = 1e-6

SUMMARY_KEYS = {
    "completed",
    "failed",
    "success_rate",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
}
LATENCY_KEYS = {
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p90", "p99")
}
QUEUE_KEYS = {f"{stat}_queued_ms" for stat in ("mean", "median", "std", "p90", "p99")}


def the_workload(
    tiny_model: Path,
    *,
    num_requests: int = USERS * REQUESTS_PER_USER,
    input_len_min: int = INPUT_LEN_MIN,
    input_len_max: int = INPUT_LEN_MAX,
    max_tokens: int = MAX_TOKENS,
    seed: int = SEED,
) -> Workload:
    spec = WorkloadSpec(
        num_requests=num_requests,
        input_len_min=input_len_min,
        input_len_max=input_len_max,
        max_tokens=max_tokens,
        temperature=0.5,
        top_p=0.9,
        seed=seed,
    )
    return build_workload(spec, load_tokenizer(str(tiny_model)), str(tiny_model))


def assert_requests_match_the_workload(requests: list[dict[str, Any]], workload: Workload) -> None:
    assert [r["index"] for r in requests] == list(range(len(workload.requests)))
    for record, asked in zip(requests, workload.requests, strict=True):
        assert record["success"], record["error"]
        # The engine rendered exactly the prompt length the workload drew.
        assert record["prompt_tokens"] == asked.prompt_tokens
        assert record["reported_prompt_tokens"] == asked.prompt_tokens
        assert INPUT_LEN_MIN <= asked.prompt_tokens <= INPUT_LEN_MAX
        assert 1 <= record["output_tokens"] <= MAX_TOKENS
        if record["finish_reason"] == "length":
            assert record["output_tokens"] == MAX_TOKENS
        assert 0 < record["ttft_s"] <= record["e2el_s"]
        assert record["ttft_s"] + sum(record["itl_s"]) <= record["e2el_s"] + CLOCK_SLACK_S


def test_a_bench_ended_by_sigterm_stops_the_worker_and_redis_it_started(
    tiny_model: Path, cli_env: dict[str, str], short_tmp: Path
) -> None:
    bench = subprocess.Popen(
        [*EDGEQ, "bench", "--start-worker", "--model", str(tiny_model), "--users", "1"],
        env=cli_env | {"TMPDIR": str(short_tmp)},  # its worker's log dir: gone with the test
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bench.stderr is not None
        for line in bench.stderr:  # the worker's engine is starting: the bench owns processes
            if "starting a private Redis and a worker" in line:
                break
        time.sleep(WORKER_STARTING_S)
        started = psutil.Process(bench.pid).children(recursive=True)
        assert {"redis-server", "python"} <= {process.name() for process in started}, started
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(CLI_TIMEOUT_S) == EXIT_INTERRUPTED
        _, alive = psutil.wait_procs(started, timeout=STOPPED_WITHIN_S)
        assert not alive, alive
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def test_bench_through_the_queue(
    worker: WorkerProcess, cli_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    out, plot = tmp_path / "report.json", tmp_path / "bench.png"
    completed = subprocess.run(
        [
            *EDGEQ,
            "bench",
            *("--users", str(USERS), "--requests-per-user", str(REQUESTS_PER_USER)),
            *("--input-len-min", str(INPUT_LEN_MIN), "--input-len-max", str(INPUT_LEN_MAX)),
            *("--max-tokens", str(MAX_TOKENS), "--seed", str(SEED)),
            *("--model", str(tiny_model), "--goodput", "ttft:60000", "e2el:60000"),
            *("--out", str(out), "--plot", str(plot)),
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Mean TTFT (ms)" in completed.stdout
    assert "Mean queue wait (ms)" in completed.stdout

    report = json.loads(out.read_text())
    assert report["config"]["num_prompts"] == USERS * REQUESTS_PER_USER
    [mode] = report["modes"]
    assert mode["name"] == "queue" and mode["error"] is None
    metrics = mode["metrics"]
    assert SUMMARY_KEYS | LATENCY_KEYS | QUEUE_KEYS <= metrics.keys()
    assert all(metrics[key] is not None for key in SUMMARY_KEYS | LATENCY_KEYS | QUEUE_KEYS)
    assert metrics["success_rate"] == 1.0
    assert metrics["completed"] == USERS * REQUESTS_PER_USER and metrics["failed"] == 0
    # Generous SLOs: every request is good, so goodput equals throughput.
    assert metrics["request_goodput"] == pytest.approx(metrics["request_throughput"])

    workload = the_workload(tiny_model)  # the same seed builds the same prompts here
    requests = mode["requests"]
    assert_requests_match_the_workload(requests, workload)
    assert metrics["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert metrics["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    for record in requests:
        assert 0 <= record["queued_ms"] <= record["worker_ttft_ms"] <= record["worker_total_ms"]
    # The client's TTFT starts before its submit, the worker's at the enqueue: the handoff
    # (submit, and the first token's way back) is what is left, and it is never free.
    assert 0 < metrics["median_handoff_ms"] < metrics["median_ttft_ms"]
    assert 0 < metrics["median_started_to_first_ms"] < metrics["median_ttft_ms"]
    assert {record["user"] for record in requests} == set(range(USERS))
    assert plot.read_bytes().startswith(PNG_MAGIC)


async def test_bench_direct_on_an_engine_in_this_process(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEQ_CPU_KV_CACHE_GIB", "1")
    monkeypatch.setenv("EDGEQ_MAX_MODEL_LEN", str(TEST_MAX_MODEL_LEN))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The engine is the worker's own ChatEngine: a worker setting reaches it.
    monkeypatch.setenv("EDGEQ_STREAM_TOKENS", str(STREAM_TOKENS))
    settings = load_settings(WorkerSettings, model=str(tiny_model))
    workload = the_workload(tiny_model)

    run: ModeRun = await run_target(
        DirectTarget(settings), workload, USERS, None, lambda: {"engine": engine_pids(os.getpid())}
    )

    assert run.error is None and run.duration_s > 0
    assert run.cpu_s["engine"] > 0  # vLLM's processes, children of this one, did the work
    requests = [record.to_json() for record in run.records]
    assert_requests_match_the_workload(requests, workload)
    for record in run.records:
        # Straight on the engine the last chunk ends the answer: vLLM's identity holds exactly.
        assert record.ttft_s + sum(record.itl_s) == pytest.approx(record.e2el_s)
        assert record.queued_ms is None
        # The first token alone, then at least STREAM_TOKENS per output (the last may be
        # shorter): never the one output per token of vLLM's default.
        later = record.output_tokens - 1
        assert len(record.itl_s) <= -(-later // STREAM_TOKENS), record
    metrics = calculate_metrics(run.records, run.duration_s).to_json()
    assert SUMMARY_KEYS | LATENCY_KEYS <= metrics.keys()
    assert metrics["success_rate"] == 1.0
    assert metrics["request_goodput"] is None
    assert "mean_queued_ms" not in metrics
    assert metrics["total_output_tokens"] == sum(r.output_tokens for r in run.records)


async def test_failed_requests_are_counted_and_the_run_goes_on(
    worker: WorkerProcess, tiny_model: Path
) -> None:
    # Prompts on both sides of the shared worker's context: the long ones end with
    # prompt_too_long, the others are answered, and the run reports both.
    workload = the_workload(
        tiny_model,
        num_requests=6,
        input_len_min=TEST_MAX_MODEL_LEN - 80,
        input_len_max=TEST_MAX_MODEL_LEN + 80,
        max_tokens=4,
        seed=0,
    )
    too_long = {r.index for r in workload.requests if r.prompt_tokens >= TEST_MAX_MODEL_LEN}
    assert 0 < len(too_long) < len(workload.requests), "the seed must draw both kinds"
    settings = load_settings(
        ConnectionSettings,
        redis_url=worker.env["EDGEQ_REDIS_URL"],
        queue=worker.env["EDGEQ_QUEUE"],
    )

    run = await run_target(QueueTarget(settings), workload, USERS, None)

    assert run.error is None
    assert {r.index for r in run.records if not r.success} == too_long
    for record in run.records:
        if not record.success:
            assert record.error is not None and "prompt_too_long" in record.error
    metrics = calculate_metrics(run.records, run.duration_s)
    assert metrics.failed == len(too_long)
    assert metrics.success_rate == pytest.approx(1 - len(too_long) / len(workload.requests))
    assert metrics.total_input_tokens == sum(
        r.prompt_tokens for r in workload.requests if r.index not in too_long
    )


class HeapProbe:
    """A target that answers every request at once and notes how many objects the garbage
    collector had frozen when it was called."""

    name = "probe"
    description = "in-process probe"

    def __init__(self) -> None:
        self.frozen: list[int] = []

    async def send(
        self, request: BenchRequest, fields: dict[str, Any], clock: ChunkClock
    ) -> Outcome:
        self.frozen.append(gc.get_freeze_count())
        clock.chunk()
        return Outcome(output_tokens=1, reported_prompt_tokens=request.prompt_tokens)


async def test_what_lives_before_a_run_is_frozen_while_it_is_measured(tiny_model: Path) -> None:
    # The bench's process holds the tokenizer (and in direct mode vLLM): a full collection of
    # it (150-680 ms on a 2-vCPU machine, 2026-12-05) in the middle of a mode pauses every
    # request in flight.
    workload = the_workload(tiny_model)
    probe = HeapProbe()
    run = await run_users(probe, workload, USERS)
    assert run.error is None and len(run.records) == len(workload.requests)
    warm_up, *measured = probe.frozen
    assert warm_up == 0
    assert len(measured) == len(workload.requests)
    assert min(measured) > 10_000  # the tokenizer's and the libraries' objects
    assert gc.get_freeze_count() == 0  # and collectable again once the mode is over
