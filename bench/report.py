"""What a run shows: a terminal table with ratios, a JSON report, and a PNG of the latencies."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edgeq.bench.cpu import CPU_ROLES
from edgeq.bench.metrics import PERCENTILES, BenchMetrics, percentile_word
from edgeq.bench.records import ModeRun

#: Failed requests quoted per mode under the table (vLLM caps its list at 10 too).
MAX_ERRORS_SHOWN = 10
LABEL_WIDTH = 40
VALUE_WIDTH = 12
MISSING = "-"
#: Wide enough for three panels side by side, readable on a laptop screen and in a PR.
FIGURE_SIZE_IN = (16.0, 5.2)
FIGURE_DPI = 110
HISTOGRAM_BINS = 30
REPORT_VERSION = 1


@dataclass(frozen=True)
class Row:
    label: str
    #: The key in ``BenchMetrics.to_json()``; None makes the row a section heading.
    key: str | None
    #: Ratios make sense for latencies and rates, not for counts of requests.
    ratio: bool = True
    integer: bool = False


def _latency_rows(name: str, key: str, title: str) -> list[Row]:
    """A section: mean, median and each percentile of one latency (vLLM's layout)."""
    return [
        Row(title, None),
        Row(f"Mean {name} (ms)", f"mean_{key}_ms"),
        Row(f"Median {name} (ms)", f"median_{key}_ms"),
        *(
            Row(f"P{percentile_word(p)} {name} (ms)", f"p{percentile_word(p)}_{key}_ms")
            for p in PERCENTILES
        ),
    ]


ROWS: tuple[Row, ...] = (
    Row("Successful requests", "completed", ratio=False, integer=True),
    Row("Failed requests", "failed", ratio=False, integer=True),
    Row("Success rate (%)", "success_rate_pct", ratio=False),
    Row("Benchmark duration (s)", "duration_s"),
    Row("Total input tokens", "total_input_tokens", ratio=False, integer=True),
    Row("Total generated tokens", "total_output_tokens", ratio=False, integer=True),
    Row("Request throughput (req/s)", "request_throughput"),
    Row("Request goodput (req/s)", "request_goodput"),
    Row("Output token throughput (tok/s)", "output_throughput"),
    Row("Total token throughput (tok/s)", "total_token_throughput"),
    Row("Bench process CPU (% of one core)", "client_cpu_pct", ratio=False),
    Row("Engine processes CPU (% of one core)", "engine_cpu_pct", ratio=False),
    Row("Worker process CPU (% of one core)", "worker_cpu_pct", ratio=False),
    Row("Redis CPU (% of one core)", "redis_cpu_pct", ratio=False),
    *(
        Row(f"{role.capitalize()} CPU per output token (µs)", f"{role}_cpu_us_per_token")
        for role in CPU_ROLES
    ),
    *_latency_rows("TTFT", "ttft", "Time to First Token"),
    *_latency_rows("TPOT", "tpot", "Time per Output Token (excl. 1st token)"),
    *_latency_rows("ITL", "itl", "Inter-chunk Latency (queue: between deltas)"),
    *_latency_rows("E2EL", "e2el", "End-to-end Latency"),
    *_latency_rows("queue wait", "queued", "Queue wait: enqueue -> worker starts the job"),
    Row("Queue wait share of mean TTFT (%)", "queued_share_of_ttft_pct", ratio=False),
    *_latency_rows("start -> 1st", "started_to_first", "In the worker: job start -> first token"),
    *_latency_rows("handoff", "handoff", "Client TTFT - worker TTFT: submit and delivery"),
)


def _table_values(run: ModeRun, metrics: BenchMetrics) -> dict[str, Any]:
    values = metrics.to_json()
    values["client_cpu_pct"] = run.client_cpu_s / run.duration_s * 100
    for role, seconds in run.cpu_s.items():
        values[f"{role}_cpu_pct"] = seconds / run.duration_s * 100
    values["success_rate_pct"] = metrics.success_rate * 100
    share = metrics.queued_share_of_ttft
    values["queued_share_of_ttft_pct"] = share * 100 if share is not None else None
    return values


def _format(value: float | None, integer: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return f"{value:.0f}" if integer else f"{value:.2f}"


def _ratio(first: float | None, other: float | None) -> str:
    if first is None or other is None or other == 0:
        return MISSING
    return f"{first / other:.2f}"


def _cells(texts: Sequence[str], widths: Sequence[int]) -> str:
    return "".join(text.rjust(width) for text, width in zip(texts, widths, strict=True))


def describe_workload(config: Mapping[str, Any]) -> str:
    return (
        f"{config['users']} concurrent users, {config['num_prompts']} requests, prompts "
        f"{config['input_len_min']}-{config['input_len_max']} tokens, max_tokens "
        f"{config['max_tokens']}, temperature {config['temperature']:g}, top_p "
        f"{config['top_p']:g}, seed {config['seed']}"
    )


def format_table(
    config: Mapping[str, Any], runs: Sequence[ModeRun], metrics: Mapping[str, BenchMetrics]
) -> str:
    """vLLM's result layout, one column per mode, then the first mode ÷ each other mode."""
    measured = [run for run in runs if run.name in metrics]
    values = {run.name: _table_values(run, metrics[run.name]) for run in measured}
    first = measured[0].name if measured else None
    others = [run.name for run in measured[1:]]
    columns = [run.name for run in measured] + [f"{first}/{other}" for other in others]
    widths = [max(VALUE_WIDTH, len(column) + 2) for column in columns]
    width = LABEL_WIDTH + sum(widths)
    lines = [
        " edgeq bench ".center(width, "="),
        f"model: {config['model']}",
        f"workload: {describe_workload(config)}",
    ]
    lines += [f"{run.name}: {run.target}" for run in runs]
    if measured:
        lines.append("".ljust(LABEL_WIDTH) + _cells(columns, widths))
    heading: str | None = None
    for row in ROWS:
        if row.key is None:
            heading = f" {row.label} ".center(width, "-")
            continue
        cells = [values[name].get(row.key) for name in values]
        if all(cell is None for cell in cells):
            continue  # e.g. goodput without SLOs, queue wait without a queue mode
        if heading is not None:  # a section shows only with a row under it
            lines.append(heading)
            heading = None
        text = [_format(cell, row.integer) for cell in cells]
        if first is not None:
            base = values[first].get(row.key)
            text += [
                _ratio(base, values[other].get(row.key)) if row.ratio else "" for other in others
            ]
        lines.append(row.label.ljust(LABEL_WIDTH) + _cells(text, widths))
    lines.append("=" * width)
    for run in runs:
        if run.error is not None:
            lines.append(f"{run.name}: NOT RUN: {run.error}")
            continue
        errors = [record for record in run.records if not record.success]
        for record in errors[:MAX_ERRORS_SHOWN]:
            lines.append(f"{run.name}: request {record.index} failed: {record.error}")
        if len(errors) > MAX_ERRORS_SHOWN:
            lines.append(f"{run.name}: ... and {len(errors) - MAX_ERRORS_SHOWN} more failures")
    return "\n".join(lines)


def build_report(
    config: Mapping[str, Any], runs: Sequence[ModeRun], metrics: Mapping[str, BenchMetrics]
) -> dict[str, Any]:
    """Everything needed to redo the figures: config, per-mode metrics, every request."""
    return {
        "version": REPORT_VERSION,
        "config": dict(config),
        "modes": [
            {
                "name": run.name,
                "target": run.target,
                "error": run.error,
                "worker": run.worker,
                "duration_s": run.duration_s,
                "client_cpu_s": run.client_cpu_s,
                "cpu_s": run.cpu_s,
                "metrics": metrics[run.name].to_json() if run.name in metrics else None,
                "requests": [record.to_json() for record in run.records],
            }
            for run in runs
        ],
    }


def write_json(report: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _cdf(ax: Any, runs: Sequence[ModeRun], attribute: str, title: str, xlabel: str) -> None:
    for run in runs:
        values = np.sort([getattr(r, attribute) * 1000 for r in run.records if r.success])
        if values.size == 0:
            continue
        shares = np.arange(1, values.size + 1) / values.size * 100
        p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
        label = f"{run.name}: p50 {p50:.0f} ms, p99 {p99:.0f} ms"
        ax.step(values, shares, where="post", linewidth=2, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests at or below (%)")
    ax.set_ylim(0, 101)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _histogram(ax: Any, runs: Sequence[ModeRun]) -> None:
    per_run = {run.name: [r.ttft_s * 1000 for r in run.records if r.success] for run in runs}
    everything = [value for values in per_run.values() for value in values]
    if everything:
        edges = np.histogram_bin_edges(everything, bins=HISTOGRAM_BINS)
        for name, values in per_run.items():
            if values:
                ax.hist(values, bins=edges, histtype="step", linewidth=2, label=name)
        ax.legend(loc="best", fontsize="small")
    ax.set_title("TTFT histogram")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("requests")
    ax.yaxis.get_major_locator().set_params(integer=True)  # counts of requests
    ax.grid(alpha=0.3)


def load_pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only backend (no display on a server); imported late,
    so the bench's other commands never pay for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path) -> None:
    """Lay out, write as PNG (creating the folder) and free the figure."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=FIGURE_DPI)
    load_pyplot().close(figure)


def plot_runs(config: Mapping[str, Any], runs: Sequence[ModeRun], path: Path) -> None:
    """Latency CDFs (TTFT, end-to-end; one line per mode) and a TTFT histogram, as a PNG."""
    plt = load_pyplot()
    measured = [run for run in runs if run.error is None]
    figure, axes = plt.subplots(1, 3, figsize=FIGURE_SIZE_IN)
    _cdf(axes[0], measured, "ttft_s", "Time to first token (CDF)", "TTFT (ms)")
    _cdf(axes[1], measured, "e2el_s", "End-to-end latency (CDF)", "E2E latency (ms)")
    _histogram(axes[2], measured)
    figure.suptitle(f"edgeq bench on {config['model']}\n{describe_workload(config)}")
    save_figure(figure, path)
