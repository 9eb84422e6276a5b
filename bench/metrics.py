"""The figures of a run, defined exactly as ``vllm bench serve`` defines them.

Source: vllm/benchmarks/serve.py (``calculate_metrics``, ``parse_goodput``,
``check_goodput_args``) of the vLLM release pinned in pyproject.toml. What is the same:

- only successful requests enter TTFT, TPOT, ITL, E2EL and the token totals;
- TPOT of a request is ``(e2el - ttft) / (output_tokens - 1)``, only for requests with more
  than one output token; for goodput such a request's TPOT counts as 0;
- ITL pools every gap of every successful request into one list (a long answer weighs more);
- statistics are numpy's ``mean``, ``median``, ``std`` and ``percentile`` (linear
  interpolation) over seconds, times 1000; an empty list counts as ``[0]``;
- throughputs divide by the wall time of the whole run, failed requests included in it;
- a request is good when every given SLO holds as ``slo_ms / 1000 >= value_s``.

Added here: the success rate, and for a queue mode where its TTFT goes, from the worker's
``done.timings``: the wait in the queue (``queued_ms``), the worker's job start → first token
(``ttft_ms - queued_ms``), and the handoff (the client's TTFT minus ``ttft_ms``: its submit
before the enqueue and the first token's way back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeq.bench.records import RequestRecord

MS_PER_S = 1000.0
#: The tails reported next to the median: the seed article quotes p90 and p99.
PERCENTILES: tuple[float, ...] = (90.0, 99.0)
#: The SLO names ``vllm bench serve --goodput`` accepts, in milliseconds.
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """mean, median, std and percentiles of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: Mapping[float, float]

    def to_json(self, name: str) -> dict[str, float]:
        """vLLM's result keys: ``mean_ttft_ms``, ``p99_ttft_ms`` and so on."""
        data = {
            f"mean_{name}_ms": self.mean_ms,
            f"median_{name}_ms": self.median_ms,
            f"std_{name}_ms": self.std_ms,
        }
        for p, value in self.percentiles_ms.items():
            data[f"p{percentile_word(p)}_{name}_ms"] = value
        return data


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    success_rate: float
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    #: None when no SLO was given (vLLM prints no goodput then).
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    #: Queue modes only: enqueue → the worker starts the job.
    queued: Distribution | None = None
    #: Queue modes only: the worker starts the job → its first token (render, the engine's
    #: prefill and first step): what the engine alone would take, plus the worker's own work.
    started_to_first: Distribution | None = None
    #: Queue modes only: the client's TTFT minus the worker's (enqueue → first token): its
    #: submit before the enqueue and the first token's way back through Redis.
    handoff: Distribution | None = None
    #: CPU µs per generated token by role (edgeq.bench.cpu.cpu_us_per_token): ``front``,
    #: ``engine``, ``redis``, ``client``; empty when the run measured no processes' CPU.
    cpu_us_per_token: Mapping[str, float] = field(default_factory=dict)

    @property
    def queued_share_of_ttft(self) -> float | None:
        """How much of the mean TTFT is the mean wait in the queue (0–1)."""
        if self.queued is None or self.ttft.mean_ms <= 0:
            return None
        return self.queued.mean_ms / self.ttft.mean_ms

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "success_rate": self.success_rate,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            data.update(getattr(self, name).to_json(name))
        if self.queued is not None:
            data.update(self.queued.to_json("queued"))
            data["queued_share_of_ttft"] = self.queued_share_of_ttft
        for name in ("started_to_first", "handoff"):
            if (spread := getattr(self, name)) is not None:
                data.update(spread.to_json(name))
        for role, us in self.cpu_us_per_token.items():
            data[f"{role}_cpu_us_per_token"] = us
        return data


def percentile_word(p: float) -> str:
    """``99.0`` → ``"99"``, ``99.9`` → ``"99.9"``, as vLLM names its keys."""
    return str(int(p)) if int(p) == p else str(p)


def distribution(
    values_s: Iterable[float], percentiles: Sequence[float] = PERCENTILES
) -> Distribution:
    """Statistics of values in seconds, reported in ms, with vLLM's ``values or 0`` rule."""
    data = np.asarray(list(values_s) or [0.0], dtype=float)
    return Distribution(
        mean_ms=float(np.mean(data)) * MS_PER_S,
        median_ms=float(np.median(data)) * MS_PER_S,
        std_ms=float(np.std(data)) * MS_PER_S,
        percentiles_ms={p: float(np.percentile(data, p)) * MS_PER_S for p in percentiles},
    )


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    if record.output_tokens <= 1:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "e2el:3000"]`` → ``{"ttft": 500.0, "e2el": 3000.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            if not sep:
                raise ValueError
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"goodput SLO {pair!r}: expected NAME:MILLISECONDS, e.g. ttft:500"
            ) from None
        if name not in SLO_METRICS:
            raise ValueError(
                f"goodput SLO {pair!r}: the name must be one of {', '.join(SLO_METRICS)}"
            )
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {pair!r}: the value must not be negative")
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request is within every SLO (vLLM: ``slo_s >= value_s``)."""
    values_s = {
        "ttft": record.ttft_s,
        "tpot": tpot_s(record) or 0.0,  # vLLM counts a one-token answer's TPOT as 0
        "e2el": record.e2el_s,
    }
    return all(slo / MS_PER_S >= values_s[name] for name, slo in slos_ms.items())


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> BenchMetrics:
    """Every figure of one mode's run; ``duration_s`` is the run's wall time."""
    if duration_s <= 0:
        raise ValueError(f"the run's duration must be positive (got {duration_s!r} s)")
    done = [record for record in records if record.success]
    tpots = [value for record in done if (value := tpot_s(record)) is not None]
    queued = [record.queued_ms / MS_PER_S for record in done if record.queued_ms is not None]
    started_to_first: list[float] = []
    handoff: list[float] = []
    for record in done:  # the worker's times: ms since the enqueue, on this machine's clock
        if record.queued_ms is not None and record.worker_ttft_ms is not None:
            started_to_first.append((record.worker_ttft_ms - record.queued_ms) / MS_PER_S)
            handoff.append(record.ttft_s - record.worker_ttft_ms / MS_PER_S)
    total_input = sum(record.input_tokens for record in done)
    total_output = sum(record.output_tokens for record in done)
    good = sum(meets_slos(record, slos_ms) for record in done) if slos_ms else None
    return BenchMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        success_rate=len(done) / len(records) if records else 0.0,
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good / duration_s if good is not None else None,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=distribution((record.ttft_s for record in done), percentiles),
        tpot=distribution(tpots, percentiles),
        itl=distribution((gap for record in done for gap in record.itl_s), percentiles),
        e2el=distribution((record.e2el_s for record in done), percentiles),
        queued=distribution(queued, percentiles) if queued else None,
        started_to_first=distribution(started_to_first, percentiles) if handoff else None,
        handoff=distribution(handoff, percentiles) if handoff else None,
    )
