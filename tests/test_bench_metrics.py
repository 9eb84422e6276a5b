"""The bench's statistics on hand-made requests whose figures are worked out by hand, and one
cross-check against vLLM's own ``calculate_metrics`` on the same requests."""

from __future__ import annotations

import math

import pytest

from edgeq.bench.metrics import (
    calculate_metrics,
    distribution,
    meets_slos,
    parse_goodput,
    percentile_word,
    tpot_s,
)
from edgeq.bench.records import RequestRecord
from edgeq.bench.runners import user_schedule


def ok(
    index: int,
    *,
    ttft: float,
    e2el: float,
    tokens: int,
    itl: tuple[float, ...] = (),
    prompt: int = 10,
    reported: int | None = None,
    queued_ms: float | None = None,
    worker_ttft_ms: float | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        user=0,
        success=True,
        start_s=0.0,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=itl,
        output_tokens=tokens,
        prompt_tokens=prompt,
        reported_prompt_tokens=reported,
        queued_ms=queued_ms,
        worker_ttft_ms=worker_ttft_ms,
    )


def failed(index: int, prompt: int = 30) -> RequestRecord:
    return RequestRecord(
        index=index, user=0, success=False, start_s=0.0, prompt_tokens=prompt, error="boom"
    )


# r1: 11 tokens, first at 100 ms, last at 1100 ms → TPOT (1100 - 100) / 10 = 100 ms.
# r2: a one-token answer at 300 ms: no TPOT, counted as 0 for goodput.
R1 = ok(0, ttft=0.1, e2el=1.1, tokens=11, itl=(0.5, 0.5), prompt=10)
R2 = ok(1, ttft=0.3, e2el=0.3, tokens=1, prompt=20, reported=21)
R3 = failed(2, prompt=30)


def test_distribution_uses_numpy_linear_percentiles_in_ms() -> None:
    stats = distribution([1.0, 2.0, 3.0, 4.0], percentiles=(90.0, 99.0))
    assert stats.mean_ms == pytest.approx(2500.0)
    assert stats.median_ms == pytest.approx(2500.0)
    assert stats.std_ms == pytest.approx(math.sqrt(1.25) * 1000)  # population std, as numpy
    # Linear interpolation: rank 0.9 * 3 = 2.7 → 3 + 0.7 = 3.7 s; rank 2.97 → 3.97 s.
    assert stats.percentiles_ms[90.0] == pytest.approx(3700.0)
    assert stats.percentiles_ms[99.0] == pytest.approx(3970.0)


def test_distribution_of_nothing_is_zero_like_vllm() -> None:
    stats = distribution([])
    assert (stats.mean_ms, stats.median_ms, stats.std_ms) == (0.0, 0.0, 0.0)
    assert set(stats.percentiles_ms.values()) == {0.0}


def test_tpot_excludes_the_first_token_and_needs_a_second() -> None:
    assert tpot_s(R1) == pytest.approx(0.1)
    assert tpot_s(R2) is None


def test_metrics_of_a_small_run() -> None:
    metrics = calculate_metrics([R1, R2, R3], duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert metrics.success_rate == pytest.approx(2 / 3)
    # The server's prompt count wins where it reported one; failures count for nothing.
    assert metrics.total_input_tokens == 10 + 21
    assert metrics.total_output_tokens == 12
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(6.0)
    assert metrics.total_token_throughput == pytest.approx((31 + 12) / 2)
    assert metrics.request_goodput is None
    assert metrics.ttft.mean_ms == pytest.approx(200.0)
    assert metrics.ttft.median_ms == pytest.approx(200.0)
    assert metrics.e2el.mean_ms == pytest.approx(700.0)
    # TPOT only from requests with a second token; ITL pools every gap.
    assert metrics.tpot.mean_ms == pytest.approx(100.0)
    assert metrics.itl.mean_ms == pytest.approx(500.0)
    assert metrics.itl.percentiles_ms[99.0] == pytest.approx(500.0)
    assert metrics.queued is None


def test_throughput_divides_by_the_whole_run() -> None:
    slow = calculate_metrics([R1, R2], duration_s=4.0)
    assert slow.request_throughput == pytest.approx(0.5)
    assert slow.output_throughput == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200.0}, 1),  # R1 at 100 ms passes, R2 at 300 ms does not
        ({"tpot": 50.0}, 1),  # R1's 100 ms fails; R2's one-token answer counts TPOT as 0
        ({"e2el": 1100.0}, 2),  # an SLO equal to the value holds
        ({"e2el": 1099.0}, 1),
        ({"ttft": 200.0, "tpot": 50.0}, 0),  # every SLO must hold
    ],
)
def test_goodput_counts_requests_within_every_slo(slos: dict[str, float], good: int) -> None:
    metrics = calculate_metrics([R1, R2, R3], duration_s=2.0, slos_ms=slos)
    assert metrics.request_goodput == pytest.approx(good / 2.0)


def test_a_failed_request_is_never_good() -> None:
    metrics = calculate_metrics([R3], duration_s=1.0, slos_ms={"e2el": 1e9})
    assert metrics.request_goodput == 0.0
    assert metrics.success_rate == 0.0
    assert metrics.ttft.mean_ms == 0.0


def test_meets_slos_compares_in_seconds_like_vllm() -> None:
    assert meets_slos(R1, {"ttft": 100.0})
    assert not meets_slos(R1, {"ttft": 99.999})


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "e2el:3000"]) == {"ttft": 500.0, "e2el": 3000.0}
    assert parse_goodput([]) == {}


@pytest.mark.parametrize("bad", ["ttft", "ttft:fast", "itl:10", "e2el:-1", ":5"])
def test_parse_goodput_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput SLO"):
        parse_goodput([bad])


def test_queue_wait_and_its_share_of_ttft() -> None:
    records = [
        ok(0, ttft=0.2, e2el=1.0, tokens=5, queued_ms=10.0),
        ok(1, ttft=0.2, e2el=1.0, tokens=5, queued_ms=30.0),
    ]
    metrics = calculate_metrics(records, duration_s=1.0)
    assert metrics.queued is not None
    assert metrics.queued.mean_ms == pytest.approx(20.0)
    assert metrics.queued_share_of_ttft == pytest.approx(0.1)
    keys = metrics.to_json()
    assert keys["p99_queued_ms"] == pytest.approx(29.8)


def test_a_queue_modes_ttft_is_split_into_wait_worker_and_handoff() -> None:
    # Client TTFT 200 ms = 10 queued + 180 from the job's start to its first token + 10 ms of
    # submit and delivery; the second request: 30 + 160 + 10.
    records = [
        ok(0, ttft=0.2, e2el=1.0, tokens=5, queued_ms=10.0, worker_ttft_ms=190.0),
        ok(1, ttft=0.2, e2el=1.0, tokens=5, queued_ms=30.0, worker_ttft_ms=190.0),
        ok(2, ttft=0.9, e2el=1.0, tokens=5),  # no worker timings (another mode): left out
    ]
    metrics = calculate_metrics(records, duration_s=1.0)
    assert metrics.started_to_first is not None and metrics.handoff is not None
    assert metrics.started_to_first.median_ms == pytest.approx(170.0)
    assert metrics.handoff.mean_ms == pytest.approx(10.0)
    keys = metrics.to_json()
    assert keys["median_started_to_first_ms"] == pytest.approx(170.0)
    assert keys["p99_handoff_ms"] == pytest.approx(10.0)
    assert calculate_metrics(records[2:], duration_s=1.0).handoff is None


def test_json_keys_are_vllms() -> None:
    keys = calculate_metrics([R1], duration_s=1.0).to_json()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in keys
    assert percentile_word(99.0) == "99" and percentile_word(99.9) == "99.9"


def test_users_send_their_requests_in_turn() -> None:
    assert user_schedule(5, 2) == [[0, 2, 4], [1, 3]]
    assert user_schedule(2, 4) == [[0], [1]]  # no idle users


def test_same_figures_as_vllm_bench_serve() -> None:
    """Feed vLLM's own calculate_metrics the same requests and compare every figure."""
    serve = pytest.importorskip("vllm.benchmarks.serve")
    request_func = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")
    records = [
        R1,
        R2,
        R3,
        ok(3, ttft=0.25, e2el=2.0, tokens=40, itl=(0.7, 0.05, 1.0), prompt=64),
        ok(4, ttft=0.05, e2el=0.9, tokens=8, itl=(0.85,), prompt=100),
    ]
    outputs = [
        request_func.RequestFuncOutput(
            success=record.success,
            latency=record.e2el_s,
            output_tokens=record.output_tokens,
            ttft=record.ttft_s,
            itl=list(record.itl_s),
            prompt_len=record.input_tokens,
        )
        for record in records
    ]
    slos = {"ttft": 200.0, "e2el": 1500.0}
    theirs, _ = serve.calculate_metrics(
        input_requests=[],
        outputs=outputs,
        dur_s=3.0,
        tokenizer=None,
        selected_percentiles=[90.0, 99.0],
        goodput_config_dict=slos,
    )
    ours = calculate_metrics(records, duration_s=3.0, slos_ms=slos)
    assert ours.completed == theirs.completed
    assert ours.failed == theirs.failed
    assert ours.total_input_tokens == theirs.total_input
    assert ours.total_output_tokens == theirs.total_output
    assert ours.request_throughput == pytest.approx(theirs.request_throughput)
    assert ours.request_goodput == pytest.approx(theirs.request_goodput)
    assert ours.output_throughput == pytest.approx(theirs.output_throughput)
    assert ours.total_token_throughput == pytest.approx(theirs.total_token_throughput)
    for name in ("ttft", "tpot", "itl", "e2el"):
        mine = getattr(ours, name)
        assert mine.mean_ms == pytest.approx(getattr(theirs, f"mean_{name}_ms"))
        assert mine.median_ms == pytest.approx(getattr(theirs, f"median_{name}_ms"))
        assert mine.std_ms == pytest.approx(getattr(theirs, f"std_{name}_ms"))
        for p, value in getattr(theirs, f"percentiles_{name}_ms"):
            assert mine.percentiles_ms[p] == pytest.approx(value)
