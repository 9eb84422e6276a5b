"""The worker's Prometheus metrics, served on EDGEQ_METRICS_HOST:EDGEQ_METRICS_PORT.

Two families share the page:

- ``edgeq:*``, measured by the worker the way a producer experiences a job: from the moment
  it was enqueued in Redis. Names follow vLLM's where the meaning is the same, with edgeq's
  prefix because the clock starts earlier (vLLM's starts when the engine gets the request).
- ``vllm:*``, the engine's own (KV-cache use, engine queue, per-step latencies), recorded by
  vLLM's Prometheus stat logger in this process (the worker builds AsyncLLM with stats on).

README's "Metrics" section lists every ``edgeq:*`` metric with a sample scrape.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import NamedTuple

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from edgeq.core.errors import ConfigError
from edgeq.core.protocol import ChatRequest, ErrorCode, Usage
from edgeq.core.scheduling import DEFAULT_PRIORITY, DEFAULT_TENANT

# vLLM's buckets (vllm/v1/metrics/loggers.py) with finer low ends: a 0.6B model on a GPU
# yields a token every few ms, and edgeq's pickup takes about one.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)  # fmt: skip


#: The tenant label of a tenant the worker's settings do not name: labels stay a bounded set.
OTHER_TENANT = "other"


#: The outcomes a tenant's requests are labelled with: done, or an error code of the fixed set.
OUTCOMES = frozenset({"done", *(code.value for code in ErrorCode)})
#: The outcome label of a code outside that set.
OTHER_OUTCOME = "other"

#: The adapter label of a job answered by the base model.
BASE_ADAPTER = "base"


def tenant_usage_counters(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """The usage ledger's view on one worker (core/ledger.py): jobs by tenant and outcome,
    tokens by tenant and kind, both counted once per job at its end (a token costs nothing)."""
    requests = Counter(
        "edgeq:tenant_requests",
        "Jobs this worker ended, by tenant and outcome: done, or the error code.",
        ["tenant", "outcome"],
        registry=registry,
    )
    tokens = Counter(
        "edgeq:tenant_tokens",
        "Tokens of the jobs this worker ended with done, by tenant and kind (prompt, "
        "completion; a continued job's whole answer), added once at each job's end.",
        ["tenant", "kind"],
        registry=registry,
    )
    return requests, tokens


class JobLabels(NamedTuple):
    priority: str
    tenant: str


class WorkerMetrics:
    """What the chat job records as it runs; one per worker process. ``tenants``: the tenants
    that get their own label (the ones the settings name; the rest count as "other")."""

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, *, tenants: Collection[str] = ()
    ) -> None:
        self.tenants = frozenset({DEFAULT_TENANT, *tenants})
        self.queue_time, self.time_to_first_token, self.inter_token_latency, self.e2e_latency = (
            _latency_metrics(registry)
        )
        self.requests, self.prompt_tokens, self.generation_tokens = _job_counters(registry)
        self.running, self.waiting, self.tenant_running, self.tenant_waiting = (
            _load_gauges(registry)
        )
        self.tenant_requests, self.tenant_tokens = tenant_usage_counters(registry)
        self.engine_stalls, self.adapter_requests = _engine_counters(registry)

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self.tenants else OTHER_TENANT

    def job_labels(self, request: ChatRequest) -> JobLabels:
        tenant = self.tenant_label(request.tenant or DEFAULT_TENANT)
        return JobLabels(request.priority or DEFAULT_PRIORITY, tenant)

    def adapter_job_started(self, adapter: str | None) -> None:
        """A job started with ``adapter``: a name the worker held (jobs naming any other are
        refused before they start), so the label set is bounded by what it loads."""
        self.adapter_requests.labels(adapter=adapter or BASE_ADAPTER).inc()

    def count_tenants(self, *, running: Mapping[str, int], waiting: Mapping[str, int]) -> None:
        for gauge, counts in ((self.tenant_running, running), (self.tenant_waiting, waiting)):
            labelled = dict.fromkeys(self.tenants, 0)
            for tenant, count in counts.items():
                label = self.tenant_label(tenant)
                labelled[label] = labelled.get(label, 0) + count
            for label, count in labelled.items():
                gauge.labels(tenant=label).set(count)

    def count_running(self, running: Callable[[], int]) -> None:
        """Read the running count at scrape time, so it can never drift from the truth."""
        self.running.set_function(running)

    def job_started(self, labels: JobLabels, *, queued_s: float, prompt_tokens: int) -> None:
        self.queue_time.labels(*labels).observe(queued_s)
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, labels: JobLabels, *, since_enqueue_s: float) -> None:
        self.time_to_first_token.labels(*labels).observe(since_enqueue_s)

    def token_tally(self) -> TokenTally:
        """A job's counter of its tokens and their gaps (TokenTally)."""
        return TokenTally(self)

    def job_ended(self, outcome: str, *, e2e_s: float | None = None) -> None:
        self.requests.labels(outcome=outcome).inc()
        if e2e_s is not None:
            self.e2e_latency.observe(e2e_s)

    def tenant_job_ended(self, tenant: str, outcome: str, usage: Usage | None) -> None:
        """A job of ``tenant`` ended here with ``outcome`` (and, done, its ``usage``)."""
        label = self.tenant_label(tenant)
        shown = outcome if outcome in OUTCOMES else OTHER_OUTCOME
        self.tenant_requests.labels(tenant=label, outcome=shown).inc()
        if usage is not None:
            self.tenant_tokens.labels(tenant=label, kind="prompt").inc(usage.prompt_tokens)
            self.tenant_tokens.labels(tenant=label, kind="completion").inc(
                usage.completion_tokens
            )


#: A job's tokens reach the counters at most this late (a scrape comes every few seconds).
TALLY_FLUSH_S = 0.1


class TokenTally:
    """One job's generated tokens and the gaps between them, counted here as each engine
    output arrives and added to the worker's metrics together, every ``TALLY_FLUSH_S`` and at
    the job's end (``flush``).

    With one engine output per token (EDGEQ_STREAM_TOKENS=1), a Counter increment and a
    Histogram observation per token (each under the metric's lock) cost ~3 µs of the worker's
    ~31 µs per token; counted here they cost a bisect and two additions. The page reads the
    same: each token's gap lands in the bucket ``Histogram.observe`` would put it in.
    """

    __slots__ = ("_flushed_s", "_gap_counts", "_gap_sum", "_metrics", "_tokens")

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics
        self._tokens = 0
        self._gap_counts = [0] * (len(TOKEN_GAP_BUCKETS_S) + 1)  # the last one is +Inf
        self._gap_sum = 0.0
        self._flushed_s = 0.0

    def add(self, count: int, *, gap_s: float | None, now_s: float) -> None:
        """``count`` new tokens; ``gap_s`` since the previous ones, None for the first
        (the rest came with it: no gap at all)."""
        if count <= 0:
            return
        self._tokens += count
        if gap_s is None:
            if count > 1:
                self._gap_counts[0] += count - 1
        else:  # spread evenly over the tokens of the output, as observed one by one
            self._gap_counts[bisect_left(TOKEN_GAP_BUCKETS_S, gap_s / count)] += count
            self._gap_sum += gap_s
        if now_s - self._flushed_s >= TALLY_FLUSH_S:
            self.flush(now_s)

    def flush(self, now_s: float = 0.0) -> None:
        """Add what was counted since the last flush to the worker's metrics."""
        self._flushed_s = now_s
        if not self._tokens:
            return
        self._metrics.generation_tokens.inc(self._tokens)
        self._metrics.inter_token_latency.add(self._gap_counts, self._gap_sum)
        self._tokens = 0
        self._gap_counts = [0] * len(self._gap_counts)
        self._gap_sum = 0.0


class BulkHistogram(Collector):
    """An unlabelled histogram that also takes many observations in one call (``add``), which
    prometheus_client's Histogram has no public call for. It reads on the page as that
    Histogram does (the ``_created`` sample aside, which serve_metrics turns off): checked by
    tests/test_metrics_tally.py. The lock is taken once per call, against a scrape's thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        counts = [0] * len(self._counts)
        counts[bisect_left(self._bounds, value)] = 1  # the first bound at or above it
        self.add(counts, value)

    def add(self, counts: Sequence[int], total: float) -> None:
        """``counts[i]`` observations in bucket ``i`` (the last one +Inf), ``total`` their sum."""
        with self._lock:
            for index, count in enumerate(counts):
                self._counts[index] += count
            self._sum += total

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            cumulative = list(accumulate(self._counts))
            total = self._sum
        bounds = [*map(floatToGoString, self._bounds), "+Inf"]
        yield HistogramMetricFamily(
            self._name,
            self._documentation,
            buckets=list(zip(bounds, cumulative, strict=True)),
            sum_value=total,
        )


def serve_metrics(host: str, port: int) -> None:
    """Serve the default registry from a daemon thread (prometheus_client's own server): a
    scrape never waits on the worker's event loop, and never blocks it."""
    disable_created_metrics()  # `*_created` series double the page and no dashboard reads them
    try:
        start_http_server(port, addr=host)
    except OSError as error:
        raise ConfigError(
            f"EDGEQ_METRICS_PORT: cannot serve metrics on {host}:{port} ({error}); "
            f"pick a free port per worker, or 0 to turn metrics off"
        ) from None


# WorkerMetrics's declarations, in the order they are registered (and exposed).
def _latency_metrics(
    registry: CollectorRegistry,
) -> tuple[Histogram, Histogram, BulkHistogram, Histogram]:
    """The job's latencies: queue time, TTFT, gaps between tokens, end to end."""
    queue_time = Histogram(
        "edgeq:request_queue_time_seconds",
        "Time from enqueue in Redis to the worker starting the job.",
        JobLabels._fields,
        buckets=LATENCY_BUCKETS_S,
        registry=registry,
    )
    time_to_first_token = Histogram(
        "edgeq:time_to_first_token_seconds",
        "Time from enqueue to the engine's first token of the answer.",
        JobLabels._fields,
        buckets=LATENCY_BUCKETS_S,
        registry=registry,
    )
    inter_token_latency = BulkHistogram(
        "edgeq:inter_token_latency_seconds",
        "Time between successive tokens of an answer (one observation per token after "
        "the first; tokens that arrive together share the gap).",
        buckets=TOKEN_GAP_BUCKETS_S,
        registry=registry,
    )
    e2e_latency = Histogram(
        "edgeq:e2e_request_latency_seconds",
        "Time from enqueue to the done event, for jobs that ended with done.",
        buckets=REQUEST_BUCKETS_S,
        registry=registry,
    )
    return queue_time, time_to_first_token, inter_token_latency, e2e_latency


def _job_counters(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """Jobs ended, by outcome, and the tokens they took and made."""
    requests = Counter(
        "edgeq:requests",
        "Jobs this worker ended, by outcome: done, or the error code.",
        ["outcome"],
        registry=registry,
    )
    prompt_tokens = Counter(
        "edgeq:prompt_tokens", "Prompt tokens of the jobs started.", registry=registry
    )
    generation_tokens = Counter(
        "edgeq:generation_tokens", "Tokens generated.", registry=registry
    )
    return requests, prompt_tokens, generation_tokens


def _load_gauges(registry: CollectorRegistry) -> tuple[Gauge, Gauge, Gauge, Gauge]:
    """What runs here and what waits in the queue, in all and by tenant."""
    running = Gauge(
        "edgeq:num_requests_running", "Jobs this worker is running.", registry=registry
    )
    waiting = Gauge(
        "edgeq:num_requests_waiting",
        "Jobs waiting in the Redis queue for any worker (sampled every lease renewal).",
        registry=registry,
    )
    tenant_running = Gauge(
        "edgeq:tenant_requests_running",
        "Jobs this worker is running, by tenant (sampled every lease renewal).",
        ["tenant"],
        registry=registry,
    )
    tenant_waiting = Gauge(
        "edgeq:tenant_requests_waiting",
        "Jobs waiting in the Redis queue, by tenant (sampled every lease renewal).",
        ["tenant"],
        registry=registry,
    )
    return running, waiting, tenant_running, tenant_waiting


def _engine_counters(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """Engine stalls, and jobs started by LoRA adapter."""
    engine_stalls = Counter(
        "edgeq:engine_stalls",
        "Times the engine held work and made no step for EDGEQ_ENGINE_STALL_S "
        "(the worker then takes no jobs until it steps again, or ends itself).",
        registry=registry,
    )
    adapter_requests = Counter(
        "edgeq:adapter_requests",
        'Jobs started, by the LoRA adapter they ran with ("base": the base model).',
        ["adapter"],
        registry=registry,
    )
    return engine_stalls, adapter_requests
