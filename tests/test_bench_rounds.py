"""``edgeq bench --rounds``: each figure's median and range over the rounds, and each
comparison as the median of the per-round ratios (not the ratio of the medians), on
hand-made requests whose figures are worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from edgeq.bench.metrics import BenchMetrics, calculate_metrics
from edgeq.bench.records import RequestRecord
from edgeq.bench.rounds import format_rounds, ratio_spreads, rounds_json, spreads


def mode(
    ttft_s: float, queued_ms: float | None = None, front_us: float | None = None
) -> BenchMetrics:
    """One request: TTFT ``ttft_s``, 11 tokens over one second (11 tok/s); ``front_us``:
    the front process's CPU µs per token."""
    record = RequestRecord(
        index=0, user=0, success=True, start_s=0.0, ttft_s=ttft_s, e2el_s=1.0,
        output_tokens=11, prompt_tokens=10, queued_ms=queued_ms,
    )  # fmt: skip
    metrics = calculate_metrics([record], duration_s=1.0, slos_ms={})
    if front_us is None:
        return metrics
    return dataclasses.replace(metrics, cpu_us_per_token={"front": front_us})


# queue/direct TTFT per round: 0.2/0.1 = 2, 0.3/0.3 = 1, 0.1/0.2 = 0.5 -> median 1.
# Front CPU per token: 60/30 = 2, 45/30 = 1.5, 40/40 = 1 -> median 1.5.
ROUNDS = [
    {"queue": mode(0.2, queued_ms=5, front_us=60), "direct": mode(0.1, front_us=30)},
    {"queue": mode(0.3, queued_ms=9, front_us=45), "direct": mode(0.3, front_us=30)},
    {"queue": mode(0.1, queued_ms=1, front_us=40), "direct": mode(0.2, front_us=40)},
]


def test_each_figure_is_the_median_of_the_rounds_with_its_range() -> None:
    queue = spreads(ROUNDS, "queue")["TTFT p50 (ms)"]
    assert queue is not None
    assert (queue.median, queue.low, queue.high) == pytest.approx((200.0, 100.0, 300.0))
    wait = spreads(ROUNDS, "queue")["queue wait p50 (ms)"]
    assert wait is not None and wait.median == pytest.approx(5.0)
    assert spreads(ROUNDS, "direct")["queue wait p50 (ms)"] is None  # no queue in that mode


def test_a_comparison_is_the_median_of_the_per_round_ratios() -> None:
    ratio = ratio_spreads(ROUNDS, "queue", "direct")["TTFT p50 (ms)"]
    assert ratio is not None
    # The ratio of the medians would be 200/200 = 1 too; the range tells them apart.
    assert (ratio.median, ratio.low, ratio.high) == pytest.approx((1.0, 0.5, 2.0))


def test_the_table_and_the_json_carry_the_same_figures() -> None:
    table = format_rounds(ROUNDS, ["queue", "direct"])
    assert "3 alternating rounds" in table
    assert "200.0 [100.0-300.0]" in table and "1.00 [0.50-2.00]" in table
    report = rounds_json(ROUNDS, ["queue", "direct"])
    assert report["rounds"] == 3
    assert report["ratios"]["queue/direct"]["TTFT p50 (ms)"]["values"] == pytest.approx(
        [2.0, 1.0, 0.5]
    )


def test_the_front_processes_cpu_per_token_is_compared_round_by_round() -> None:
    ratio = ratio_spreads(ROUNDS, "queue", "direct")["front CPU µs/token"]
    assert ratio is not None
    assert (ratio.median, ratio.low, ratio.high) == pytest.approx((1.5, 1.0, 2.0))
    table = format_rounds(ROUNDS, ["queue", "direct"])
    assert "45.0 [40.0-60.0]" in table and "1.50 [1.00-2.00]" in table
    assert "redis CPU µs/token" not in table  # no run measured it
