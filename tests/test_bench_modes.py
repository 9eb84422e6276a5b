"""Which modes `edgeq bench` runs for which flags, in which order, under which names."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edgeq.bench.cli import UsageError, plan_modes
from edgeq.bench.gpu_rate import GpuRate
from edgeq.bench.runners import ModeKind


def flags(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "start_worker": False, "queue": False, "direct": False, "openai": None, "compare": None,
        "simulate_gpu": False, "step_ms": 30.0, "prefill_ms": 30.0,
    }  # fmt: skip
    return argparse.Namespace(**(values | given))


def test_no_flag_is_the_running_workers_queue() -> None:
    assert [(plan.name, plan.kind) for plan in plan_modes(flags())] == [("queue", ModeKind.QUEUE)]


def test_several_openai_servers_run_in_the_order_given_under_numbered_names() -> None:
    plans = plan_modes(
        flags(queue=True, direct=True, openai=["http://gateway:8080", "http://vllm:8000"])
    )
    assert [(plan.name, plan.kind, plan.url) for plan in plans] == [
        ("queue", ModeKind.QUEUE, None),
        ("direct", ModeKind.DIRECT, None),
        ("openai", ModeKind.OPENAI, "http://gateway:8080"),
        ("openai-2", ModeKind.OPENAI, "http://vllm:8000"),
    ]


def test_openai_alone_runs_no_queue_mode() -> None:
    plans = plan_modes(flags(openai=["http://vllm:8000"]))
    assert [plan.name for plan in plans] == ["openai"]


def test_a_running_worker_and_a_started_one_are_refused_together() -> None:
    with pytest.raises(UsageError, match="pick one"):
        plan_modes(flags(queue=True, start_worker=True))


def test_a_simulated_gpu_runs_the_worker_and_the_engine_the_bench_starts_not_a_server(
    tmp_path: Path,
) -> None:
    env_file = tmp_path / "a.env"
    env_file.write_text("EDGEQ_STREAM_INTERVAL_MS=50\n")
    plans = plan_modes(
        flags(
            start_worker=True,
            direct=True,
            compare=[env_file],
            openai=["http://vllm:8000"],
            simulate_gpu=True,
            step_ms=5.0,
            prefill_ms=20.0,
        )
    )
    rate = GpuRate(step_ms=5.0, prefill_ms=20.0)
    assert [(plan.name, plan.gpu) for plan in plans] == [
        ("queue", rate), ("a", rate), ("direct", rate), ("openai", None),
    ]  # fmt: skip


def test_a_simulated_gpu_with_nothing_the_bench_starts_is_refused() -> None:
    with pytest.raises(UsageError, match="--simulate-gpu applies to what the bench starts"):
        plan_modes(flags(queue=True, openai=["http://gateway:8080"], simulate_gpu=True))
