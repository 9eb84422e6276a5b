"""A job's TokenTally (worker/metrics.py) counts tokens and their gaps per engine output and
adds them to the metrics in one go: the page must read exactly as when every token was
counted and observed on its own (what the worker did before, and what the README documents)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from edgeq.worker.metrics import TALLY_FLUSH_S, TOKEN_GAP_BUCKETS_S, WorkerMetrics

# (tokens in the output, seconds since the previous output; None for the first output)
OUTPUTS = [(3, None), (1, 0.004), (2, 0.03), (1, 0.0), (4, 0.9), (1, 100.0), (1, 0.001)]


def observed_one_by_one() -> CollectorRegistry:
    """Each token counted and its gap observed on its own, by prometheus_client's own Counter
    and Histogram under the worker's names."""
    registry = CollectorRegistry()
    tokens = Counter("edgeq:generation_tokens", "Tokens generated.", registry=registry)
    gaps_s = Histogram(
        "edgeq:inter_token_latency_seconds", "gaps", buckets=TOKEN_GAP_BUCKETS_S, registry=registry
    )
    for count, gap_s in OUTPUTS:
        tokens.inc(count)
        gaps = [0.0] * (count - 1) if gap_s is None else [gap_s / count] * count
        for gap in gaps:
            gaps_s.observe(gap)
    return registry


def page(registry: CollectorRegistry) -> dict[str, float]:
    samples = {}
    for line in generate_latest(registry).decode().splitlines():
        # `_created` aside: the worker turns those series off (serve_metrics).
        names = ("edgeq:inter_token_latency", "edgeq:generation_tokens")
        if line.startswith(names) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_a_flushed_tally_reads_as_tokens_observed_one_by_one() -> None:
    registry = CollectorRegistry()
    tally = WorkerMetrics(registry).token_tally()
    for count, gap_s in OUTPUTS:
        tally.add(count, gap_s=gap_s, now_s=0.0)  # never due: only the flush adds them
    tally.flush()
    tally.flush()  # nothing counted since: nothing added twice
    got, expected = page(registry), page(observed_one_by_one())
    assert got.keys() == expected.keys()
    assert got == pytest.approx(expected)
    assert len([name for name in got if "_bucket" in name]) == len(TOKEN_GAP_BUCKETS_S) + 1


def test_a_tally_adds_what_it_counted_once_the_flush_interval_is_up() -> None:
    registry = CollectorRegistry()
    tally = WorkerMetrics(registry).token_tally()
    tally.add(1, gap_s=None, now_s=100.0)  # the job's first tokens show at once
    assert page(registry)["edgeq:generation_tokens_total"] == 1
    tally.add(2, gap_s=0.01, now_s=100.0 + TALLY_FLUSH_S / 2)
    assert page(registry)["edgeq:generation_tokens_total"] == 1
    tally.add(1, gap_s=0.01, now_s=100.0 + 2 * TALLY_FLUSH_S)
    assert page(registry)["edgeq:generation_tokens_total"] == 4
    assert page(registry)["edgeq:inter_token_latency_seconds_count"] == 3


def test_observations_one_at_a_time_read_as_prometheus_clients_histogram() -> None:
    """``observe`` (a single gap, the edges of each bucket included) lands where
    prometheus_client's ``Histogram.observe`` puts it."""
    values = [0.0, *TOKEN_GAP_BUCKETS_S, 0.0011, 79.9, 80.5, 1e6]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    gaps = WorkerMetrics(ours).inter_token_latency
    reference = Histogram(
        "edgeq:inter_token_latency_seconds", "gaps", buckets=TOKEN_GAP_BUCKETS_S, registry=theirs
    )
    for value in values:
        gaps.observe(value)
        reference.observe(value)
    got = {name: value for name, value in page(ours).items() if "inter_token" in name}
    assert got == pytest.approx(page(theirs))
    assert got["edgeq:inter_token_latency_seconds_count"] == len(values)
