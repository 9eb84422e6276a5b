"""Several alternating rounds of the same modes, summed up as median and range.

This box and its like are shared and noisy (10-40 % between runs), so one run of each mode
says little: ``edgeq bench --rounds N`` runs every mode N times, alternating (queue, direct,
queue, direct, ...), and reports each figure as the median over the rounds with its min-max,
and each comparison as the median of the per-round ratios (a ratio inside one round compares
modes that ran seconds apart, under the same load).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgeq.bench.cpu import CPU_ROLES
from edgeq.bench.metrics import BenchMetrics

Round = Mapping[str, BenchMetrics]  # mode name -> its metrics in that round


@dataclass(frozen=True)
class Figure:
    label: str
    read: Callable[[BenchMetrics], float | None]
    integer: bool = False


FIGURES: tuple[Figure, ...] = (
    Figure("TTFT p50 (ms)", lambda m: m.ttft.median_ms),
    Figure("TTFT p99 (ms)", lambda m: m.ttft.percentiles_ms.get(99.0)),
    Figure("TPOT p50 (ms)", lambda m: m.tpot.median_ms),
    Figure("E2E p50 (ms)", lambda m: m.e2el.median_ms),
    Figure("output tok/s", lambda m: m.output_throughput, integer=True),
    Figure("queue wait p50 (ms)", lambda m: None if m.queued is None else m.queued.median_ms),
    Figure(
        "worker start->1st p50 (ms)",
        lambda m: None if m.started_to_first is None else m.started_to_first.median_ms,
    ),
    Figure("handoff p50 (ms)", lambda m: None if m.handoff is None else m.handoff.median_ms),
    Figure("success (%)", lambda m: m.success_rate * 100),
    *(
        Figure(f"{role} CPU µs/token", lambda m, role=role: m.cpu_us_per_token.get(role))
        for role in CPU_ROLES
    ),
)


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def show(self, integer: bool = False, digits: int = 1) -> str:
        def one(value: float) -> str:
            return f"{value:,.0f}" if integer else f"{value:,.{digits}f}"

        return f"{one(self.median)} [{one(self.low)}-{one(self.high)}]"


def spread_text(values: Sequence[float], digits: int = 1) -> str:
    """``median [min-max]`` of one figure's values over the rounds ("-" for none)."""
    spread = Spread.of(values)
    return "-" if spread is None else spread.show(digits=digits)


def spreads(rounds: Sequence[Round], mode: str) -> dict[str, Spread | None]:
    return {
        figure.label: Spread.of(
            [value for r in rounds if mode in r and (value := figure.read(r[mode])) is not None]
        )
        for figure in FIGURES
    }


def ratio_spreads(rounds: Sequence[Round], first: str, other: str) -> dict[str, Spread | None]:
    """first ÷ other, per round, then median and range of those ratios."""
    result: dict[str, Spread | None] = {}
    for figure in FIGURES:
        ratios = []
        for r in rounds:
            if first in r and other in r:
                a, b = figure.read(r[first]), figure.read(r[other])
                if a is not None and b:
                    ratios.append(a / b)
        result[figure.label] = Spread.of(ratios)
    return result


def format_rounds(rounds: Sequence[Round], modes: Sequence[str]) -> str:
    """One table: each mode's median [min-max] over the rounds, then first ÷ each other."""
    label_width = max(len(f.label) for f in FIGURES) + 2
    first, others = modes[0], modes[1:]
    columns = [*modes, *(f"{first}/{other}" for other in others)]
    cells: dict[str, dict[str, str]] = {}
    for mode in modes:
        cells[mode] = {
            label: "" if spread is None else spread.show(figure.integer)
            for figure, (label, spread) in zip(FIGURES, spreads(rounds, mode).items(), strict=True)
        }
    for other in others:
        cells[f"{first}/{other}"] = {
            label: "" if spread is None else spread.show(digits=2)
            for label, spread in ratio_spreads(rounds, first, other).items()
        }
    widths = [
        max(len(column), *(len(cells[column][f.label]) for f in FIGURES)) + 2 for column in columns
    ]
    width = label_width + sum(widths)
    lines = [
        f" {len(rounds)} alternating rounds: median [min-max] ".center(width, "="),
        "".ljust(label_width) + "".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)),
    ]
    for figure in FIGURES:
        row = [cells[column][figure.label] for column in columns]
        if any(row):
            lines.append(
                figure.label.ljust(label_width)
                + "".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            )
    lines.append("=" * width)
    return "\n".join(lines)


def rounds_json(rounds: Sequence[Round], modes: Sequence[str]) -> dict[str, Any]:
    def plain(spread: Spread | None) -> dict[str, Any] | None:
        return None if spread is None else {
            "median": spread.median, "min": spread.low, "max": spread.high,
            "values": list(spread.values),
        }  # fmt: skip

    first, others = modes[0], modes[1:]
    return {
        "rounds": len(rounds),
        "modes": {mode: {k: plain(v) for k, v in spreads(rounds, mode).items()} for mode in modes},
        "ratios": {
            f"{first}/{other}": {
                k: plain(v) for k, v in ratio_spreads(rounds, first, other).items()
            }
            for other in others
        },
    }
