"""``edgeq bench``: build the workload, run each mode in turn, print and save the figures.

The parser lives in ``edgeq.bench.commands``; this module is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dotenv import dotenv_values
from tqdm import tqdm

from edgeq.bench.cpu import cpu_us_per_token
from edgeq.bench.gpu_rate import GpuRate
from edgeq.bench.metrics import BenchMetrics, calculate_metrics, parse_goodput
from edgeq.bench.records import ModeRun
from edgeq.bench.report import build_report, format_table, plot_runs, write_json
from edgeq.bench.rounds import format_rounds, rounds_json
from edgeq.bench.runners import ModeKind, ModePlan, run_plan
from edgeq.bench.workload import (
    Workload,
    WorkloadError,
    WorkloadSpec,
    build_workload,
    load_tokenizer,
)
from edgeq.core.errors import ConfigError
from edgeq.core.settings import load_settings
from edgeq.exit_codes import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_USAGE,
)

#: The shell's status for a run ended by Ctrl-C (128 + SIGINT), as ``edgeq chat`` returns.


class UsageError(ValueError):
    """The command line asks for something that cannot run; the message says what."""


def _say(message: str) -> None:
    print(f"edgeq bench: {message}", file=sys.stderr, flush=True)


class ProgressBar:
    """tqdm on stderr over the measured requests only (not the set-up before them)."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._bar: tqdm[Any] | None = None

    def start(self, total: int) -> None:
        self._bar = tqdm(total=total, desc=self._label, unit="req", file=sys.stderr)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _unique(name: str, taken: set[str]) -> str:
    candidate, number = name, 2
    while candidate in taken:
        candidate, number = f"{name}-{number}", number + 1
    taken.add(candidate)
    return candidate


def plan_modes(args: argparse.Namespace) -> list[ModePlan]:
    """The modes in the order they run: queue, compared workers, direct, OpenAI."""
    if args.start_worker and args.queue:
        raise UsageError("--queue uses a running worker, --start-worker starts one: pick one")
    starts_engines = args.start_worker or args.direct or args.compare is not None
    if args.simulate_gpu and not starts_engines:
        raise UsageError(
            "--simulate-gpu applies to what the bench starts: add --start-worker, --direct or "
            "--compare (a running worker or server is simulated only if it was started so)"
        )
    gpu = GpuRate(step_ms=args.step_ms, prefill_ms=args.prefill_ms) if args.simulate_gpu else None
    taken: set[str] = set()
    plans: list[ModePlan] = []
    others = args.direct or bool(args.openai) or args.compare is not None
    if args.start_worker:
        plans.append(ModePlan(_unique("queue", taken), ModeKind.QUEUE, worker_env={}, gpu=gpu))
    elif args.queue or not others:
        plans.append(ModePlan(_unique("queue", taken), ModeKind.QUEUE))
    for env_file in args.compare or ():
        if not env_file.is_file():
            raise UsageError(f"--compare: {env_file} is not a file")
        values = {key: value for key, value in dotenv_values(env_file).items() if value is not None}
        plans.append(
            ModePlan(_unique(env_file.stem, taken), ModeKind.QUEUE, worker_env=values, gpu=gpu)
        )
    if args.direct:
        plans.append(ModePlan(_unique("direct", taken), ModeKind.DIRECT, gpu=gpu))
    for url in args.openai or ():
        plans.append(ModePlan(_unique("openai", taken), ModeKind.OPENAI, url=url))
    return plans


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    if args.users < 1:
        raise UsageError("--users must be at least 1")
    if args.requests_per_user < 1:
        raise UsageError("--requests-per-user must be at least 1")
    num = args.num_prompts if args.num_prompts is not None else args.users * args.requests_per_user
    return WorkloadSpec(
        num_requests=num,
        input_len_min=args.input_len_min,
        input_len_max=args.input_len_max,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


def default_model() -> str:
    """EDGEQ_MODEL (environment or .env), the model a worker on this box would load."""
    from edgeq.worker.settings import WorkerSettings  # settings only: no engine is imported

    return load_settings(WorkerSettings).model


def run_config(
    spec: WorkloadSpec,
    users: int,
    slos_ms: Mapping[str, float],
    model: str,
    template_tokens: int,
) -> dict[str, Any]:
    return {
        "model": model,
        "users": users,
        "num_prompts": spec.num_requests,
        "input_len_min": spec.input_len_min,
        "input_len_max": spec.input_len_max,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "seed": spec.seed,
        "goodput_slos_ms": dict(slos_ms),
        "template_tokens": template_tokens,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
    }


def collect_metrics(
    runs: Sequence[ModeRun], slos_ms: Mapping[str, float]
) -> dict[str, BenchMetrics]:
    metrics: dict[str, BenchMetrics] = {}
    for run in runs:
        if run.error is None and run.records:
            figures = calculate_metrics(run.records, run.duration_s, slos_ms)
            # Processes watched but no worker among them: the engine (--direct) ran its front
            # end in this process, which is then the front.
            per_token = cpu_us_per_token(
                run.cpu_s, run.client_cpu_s, figures.total_output_tokens,
                in_process="worker" not in run.cpu_s,
            ) if run.cpu_s else {}  # fmt: skip
            metrics[run.name] = dataclasses.replace(figures, cpu_us_per_token=per_token)
    return metrics


def setup_failed(error: Exception) -> int:
    """Say what is wrong with the options or settings; the exit status that goes with it."""
    _say(str(error))
    return EXIT_CONFIG if isinstance(error, ConfigError) else EXIT_USAGE


def prepare_workload(spec: WorkloadSpec, model: str) -> tuple[Workload, Callable[[str], int]] | int:
    """The workload and a token counter for `model`, or the exit status saying why not."""
    try:
        tokenizer = load_tokenizer(model)
    except (OSError, ValueError) as error:
        _say(f"cannot load the tokenizer of {model}: {error}")
        return EXIT_CONFIG
    try:
        workload = build_workload(spec, tokenizer, model)
    except WorkloadError as error:
        _say(str(error))
        return EXIT_USAGE

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return workload, count_tokens


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        plans = plan_modes(args)
        spec = workload_spec(args)
        slos_ms = parse_goodput(args.goodput or ())
        model = args.model or default_model()
    except (UsageError, WorkloadError, ValueError, ConfigError) as error:
        return setup_failed(error)

    _say(f"building the workload with the tokenizer of {model}")
    prepared = prepare_workload(spec, model)
    if isinstance(prepared, int):
        return prepared
    workload, count_tokens = prepared

    if args.rounds < 1:
        return setup_failed(UsageError("--rounds must be at least 1"))
    rounds: list[list[ModeRun]] = []
    # A SIGTERM (a timeout, a supervisor) ends the run as Ctrl-C does: on the way out through
    # KeyboardInterrupt, which stops the workers and Redis the run started (else they outlive
    # it, an engine holding gigabytes).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for number in range(1, args.rounds + 1):
            rounds.append([])
            for plan in plans:
                label = plan.name if args.rounds == 1 else f"{plan.name} (round {number})"
                engine = "engine" if plan.gpu is None else plan.gpu.describe()
                if plan.worker_env is not None:
                    _say(f"{label}: starting a private Redis and a worker (its {engine} first)")
                elif plan.kind is ModeKind.DIRECT:
                    _say(f"{label}: building the {engine} in this process")
                run = run_plan(
                    plan, workload, args.users, count_tokens=count_tokens,
                    progress=ProgressBar(label),
                )  # fmt: skip
                if run.error is not None:
                    _say(f"{label}: {run.error}")
                rounds[-1].append(run)
    except KeyboardInterrupt:  # workers and Redis started here are stopped on the way out
        _say("interrupted")
        return EXIT_INTERRUPTED

    config = run_config(spec, args.users, slos_ms, model, workload.template_tokens)
    config["modes"] = [
        {
            "name": p.name,
            "kind": p.kind.value,
            "url": p.url,
            "engine": p.gpu.describe() if p.gpu is not None else None,
        }
        for p in plans
    ]
    config["rounds"] = args.rounds
    round_metrics = [collect_metrics(runs, slos_ms) for runs in rounds]
    for number, (runs, metrics) in enumerate(zip(rounds, round_metrics, strict=True), 1):
        if args.rounds > 1:
            print(f"round {number} of {args.rounds}")
        print(format_table(config, runs, metrics))
    if args.rounds > 1:
        print(format_rounds(round_metrics, [plan.name for plan in plans]))
    # The plot and the per-request report show the last round; the JSON adds the rounds' spread.
    runs, metrics = rounds[-1], round_metrics[-1]
    if args.out is not None:
        report = build_report(config, runs, metrics)
        if args.rounds > 1:
            report["rounds"] = rounds_json(round_metrics, [plan.name for plan in plans])
        write_json(report, args.out)
        _say(f"report written to {args.out}")
    if args.plot is not None:
        plot_runs(config, runs, args.plot)
        _say(f"plot written to {args.plot}")
    ok = all(run.error is None for runs in rounds for run in runs)
    return EXIT_OK if ok else EXIT_JOB_FAILED
