"""Who goes first, measured: what the claim costs at long queues, the shares tenants get from a
real worker, and interactive TTFT on a box busy with batch work (src/edgeq/core/scheduling.py).

    .venv/bin/python scripts/measure_priority.py claim --sizes 100,100000 --rounds 3
    .venv/bin/python scripts/measure_priority.py fairness --backlog 500 --seconds 60
    .venv/bin/python scripts/measure_priority.py interference --users 50 --batch-jobs 2000 \
        --rounds 3 --max-tokens 256 --batch-max-tokens 256

(those are the defaults). Each prints a table; ``--out FILE.json`` also writes the raw
figures. Quick checks: ``claim --sizes 100,10000 --rounds 1``, ``fairness --backlog 50
--seconds 20``, ``interference --users 10 --batch-jobs 100 --rounds 1 --max-tokens 32``.

- ``claim`` (Redis only): a fresh queue of each size, its jobs spread evenly over tenants a, b
  and c (weights 3, 1, 1) and the three classes; then ``--claims`` claim rounds as a worker with
  16 free slots makes them: ``claim_due_jobs``, which looks at the queue's first 320 due jobs
  (arq's queue_read_limit for the default 64 jobs). Each claimed job then finishes at once (its
  keys go, as arq's finish removes them) and a new job of its tenant and class is enqueued,
  outside the timing, so the length stays constant. Pickup: the client's round trip of the
  claim. Script: Redis's own time in the claim's EVALSHA (INFO commandstats, read around each
  claim). CPU: Redis's main thread (INFO cpu) across each claim round, I/O included, less the
  same across nothing (the INFO calls' own cost). Sizes alternate over ``--rounds``.
- ``fairness`` (a worker on the tiny model, EDGEQ_TENANT_WEIGHTS=a=3,b=1): ~``--backlog`` jobs
  of tenant a and of b kept queued (max_tokens 8, default class); after ``--warmup`` s, the
  jobs of each that finished, and that started, within ``--seconds`` s; then tenant c (weight
  1) arrives with a backlog of its own: the job starts between its arrival and its first
  job's start, and the tenants' shares of the ``--after-c`` starts from then on. A job's start
  and end: its enqueue time (``et`` in its payload, read right after the submit) plus its done
  event's timings (read from its stream when the run is over); all on this box's one clock.
- ``interference`` (a worker on the tiny model): rounds of (a) the seed's 50 interactive users
  at once on an idle worker, then (b) the same after ``--batch-jobs`` batch jobs (tenant
  nightly) were queued and the worker runs as many as its slots for them allow (batch jobs
  leave EDGEQ_RESERVED_SLOTS free). TTFT is the client's: submit called -> first delta. Batch
  tokens/s from the worker's edgeq:generation_tokens counter less the interactive answers'
  tokens. Each run's prompts are the seed's words rotated (same lengths, no prefix
  shared with an earlier run: prefix caching would make later runs look faster). Leftover
  batch jobs are cancelled between rounds. The
  burst comes seconds after the batch was queued, before any of it aged; to see a backlog that
  has (it then takes the reserved slots too), run with EDGEQ_PRIORITY_AGING_S=1 --settle 4.

Jobs that nobody needs to read (the backlogs) are submitted and their streams closed at once,
as a fire-and-forget producer would (the worker runs with EDGEQ_ABANDON_AFTER_S=0); a client
following thousands of queued streams checks each one's lease every second, and that Redis
and CPU load would be the producer's, not the box's. The worker inherits this environment:
EDGEQ_PRIORITY_AGING_S, EDGEQ_RESERVED_SLOTS, EDGEQ_ENGINE_SCHEDULING=fcfs, ... apply.
The box is shared and noisy: compare figures inside one round, and look at the ranges.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

from arq.utils import timestamp_ms
from redis.asyncio import Redis

from edgeq.bench.rounds import Spread
from edgeq.bench.workload import (
    BenchRequest,
    Workload,
    WorkloadSpec,
    build_workload,
    load_tokenizer,
)
from edgeq.core.events import finished_with
from edgeq.core.keys import in_progress_key, job_key, leases_key, tenant_of_key
from edgeq.core.protocol import ChatMessage, DeltaEvent, DoneEvent, ErrorEvent
from edgeq.core.scheduling import PRIORITIES, Priority, Tenancy, publish_tenancy, queued_by_tenant
from edgeq.producer.client import ChatClient
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.testing.processes import RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.claim import claim_due_jobs

QUEUE = "edgeq:measure-priority"
LONG_DEADLINE_S = 3600.0  # backlogs wait long; they must not expire
GATHER = 500  # calls in flight at once when filling, submitting or cancelling
A = TypeVar("A")
T = TypeVar("T")

# --- shared ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spread(values: Sequence[float], digits: int = 1) -> str:
    figure = Spread.of(values)
    return "n/a" if figure is None else figure.show(digits=digits)


async def in_chunks(call: Callable[[A], Awaitable[T]], items: Sequence[A]) -> list[T]:
    """``call`` on every item, GATHER at a time; the results in the items' order."""
    results: list[T] = []
    for start in range(0, len(items), GATHER):
        results += await asyncio.gather(*(call(item) for item in items[start : start + GATHER]))
    return results


def write_out(path: Path | None, command: str, args: argparse.Namespace, **report: Any) -> None:
    if path is not None:
        options = {key: value for key, value in vars(args).items() if key not in ("run", "out")}
        report = {"command": command, "args": options, **report}
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nraw figures: {path}")


@contextmanager
def tiny_worker(env: dict[str, str], tag: str) -> Iterator[tuple[RedisServer, WorkerProcess, Path]]:
    """A private redis-server and one warm worker on the tiny model; both stopped on exit."""
    scratch = Path(tempfile.mkdtemp(prefix=f"edgeq-priority-{tag}-"))
    model = make_tiny_model(scratch / "tiny-model").directory
    redis_server = RedisServer().start()
    worker: WorkerProcess | None = None
    try:
        worker_env = tiny_model_env(model, redis_server.url, QUEUE) | {
            "EDGEQ_MAX_MODEL_LEN": "2048",
            "EDGEQ_MAX_QUEUE": "0",
            "EDGEQ_ABANDON_AFTER_S": "0",  # the backlogs' streams are not followed
            **env,
        }
        worker = WorkerProcess(worker_env, scratch / "worker.log").start()
        worker.wait_ready()
        yield redis_server, worker, model
    finally:
        if worker is not None:
            worker.stop()
        redis_server.stop()


def worker_slots(worker: WorkerProcess) -> tuple[int, int]:
    """(max_jobs, slots batch jobs leave free), as the worker computes them."""
    assert worker.ready_event is not None
    max_jobs = int(str(worker.ready_event["max_jobs"]))
    return max_jobs, int(os.environ.get("EDGEQ_RESERVED_SLOTS", max_jobs // 4))


async def scrape(worker: WorkerProcess) -> dict[str, float]:
    """The worker's edgeq:* series without labels, e.g. edgeq:generation_tokens_total."""
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"

    def read() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    values = {}
    for line in (await asyncio.to_thread(read)).splitlines():
        if line.startswith("edgeq:") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@dataclass
class Submitted:
    job_id: str
    tenant: str
    enqueued_s: float  # the payload's `et`: the clock the worker's timings start from


async def submit_unread(client: ChatClient, messages: Any, **fields: Any) -> Submitted:
    """Submit and close the stream at once (the job goes on); note its enqueue time."""
    before = time.time()
    job = await client.submit(messages, deadline_s=LONG_DEADLINE_S, **fields)
    raw = await client.redis.get(job_key(job.job_id))  # gone only if it already finished
    await job.aclose()
    enqueued_s = json.loads(raw)["et"] / 1000 if raw else before
    return Submitted(job.job_id, fields["tenant"], enqueued_s)


async def wait_idle(client: ChatClient, timeout_s: float = 600.0) -> None:
    """Until no job is queued or running (arq keeps running jobs in the queue)."""
    deadline = time.monotonic() + timeout_s
    while await client.queue.depth():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the queue still holds jobs after {timeout_s:g} s")
        await asyncio.sleep(0.2)


# --- claim -------------------------------------------------------------------------------------

CLAIM_TENANTS = ("a", "b", "c")
CLAIM_TENANCY = Tenancy(weights={"a": 3, "b": 1})  # the worker's default aging (60 s)
READ_LIMIT = max(64 * 5, 100)  # arq's queue_read_limit, max(max_jobs * 5, 100), for 64 jobs
FREE_SLOTS = 16
REQUEST = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
WARM_CLAIMS = 50
INFO_PAIRS = 500


async def fill(jobs: JobQueue, kinds: Sequence[tuple[str, Priority]], ids: Iterator[int]) -> None:
    async def one(kind: tuple[str, Priority]) -> Enqueued:
        tenant, priority = kind
        job_id = f"{next(ids)}.{tenant}.{priority}"  # a refill copies tenant and class from it
        outcome = await jobs.enqueue(
            job_id, REQUEST, deadline_s=LONG_DEADLINE_S, max_depth=0, tenant=tenant,
            priority=priority,
        )  # fmt: skip
        return outcome.outcome

    assert set(await in_chunks(one, kinds)) == {Enqueued.ACCEPTED}


async def redis_counters(redis: Redis) -> tuple[float, float]:
    """(Redis main thread's CPU seconds, µs spent in EVALSHA calls) so far."""
    info = await redis.info("cpu", "commandstats")
    cpu = info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"]
    return cpu, float(info.get("cmdstat_evalsha", {}).get("usec", 0))


async def claim_round(redis: Redis) -> tuple[float, list[str]]:
    """A worker's poll with FREE_SLOTS free: its claim, which reads the queue's head itself."""
    began = time.perf_counter()
    claimed = await claim_due_jobs(
        redis, QUEUE, wanted=FREE_SLOTS, wanted_batch=FREE_SLOTS, scan_limit=READ_LIMIT,
        ttl_ms=60_000, lease_ttl_ms=10_000, now_ms=timestamp_ms(),
    )  # fmt: skip
    return time.perf_counter() - began, [job.job_id for job in claimed]


async def finish_and_refill(
    redis: Redis, jobs: JobQueue, claimed: list[str], ids: Iterator[int]
) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in claimed:  # what arq's finish and the lease's release remove
            pipe.delete(in_progress_key(job_id), job_key(job_id))
            pipe.zrem(QUEUE, job_id)
            pipe.zrem(leases_key(QUEUE), job_id)
        await pipe.execute()
    kinds = [job_id.split(".")[1:] for job_id in claimed]
    await fill(jobs, [(tenant, cast(Priority, priority)) for tenant, priority in kinds], ids)


async def measure_claims(redis: Redis, size: int, claims: int) -> dict[str, float]:
    await redis.flushall()
    await publish_tenancy(redis, QUEUE, CLAIM_TENANCY)
    jobs, ids = JobQueue(redis, QUEUE), itertools.count()
    kinds = [(CLAIM_TENANTS[n % 3], PRIORITIES[n // 3 % 3]) for n in range(size)]
    began = time.perf_counter()
    await fill(jobs, kinds, ids)
    fill_rate = size / (time.perf_counter() - began)
    latencies: list[float] = []
    cpu_s = script_us = 0.0
    taken = 0
    for index in range(WARM_CLAIMS + claims):
        cpu_before, script_before = await redis_counters(redis)
        elapsed, claimed = await claim_round(redis)
        cpu_after, script_after = await redis_counters(redis)
        await finish_and_refill(redis, jobs, claimed, ids)
        if index >= WARM_CLAIMS:
            latencies.append(elapsed * 1e6)
            cpu_s += cpu_after - cpu_before
            script_us += script_after - script_before
            taken += len(claimed)
    idle_cpu_s = 0.0
    for _ in range(INFO_PAIRS):  # the INFO pair's own CPU, with nothing between
        first, _ = await redis_counters(redis)
        second, _ = await redis_counters(redis)
        idle_cpu_s += second - first
    assert await redis.zcard(QUEUE) == size, "the queue's length drifted"
    return {
        "size": size,
        "claims": claims,
        "jobs_per_claim": taken / claims,
        "pickup_p50_us": statistics.median(latencies),
        "pickup_p99_us": percentile(latencies, 0.99),
        "script_us_per_claim": script_us / claims,
        "redis_cpu_us_per_claim": (cpu_s / claims - idle_cpu_s / INFO_PAIRS) * 1e6,
        "enqueue_jobs_per_s": fill_rate,
    }


CLAIM_COLUMNS = (
    ("pickup p50 (µs)", "pickup_p50_us"),
    ("pickup p99 (µs)", "pickup_p99_us"),
    ("claim script exec (µs)", "script_us_per_claim"),
    ("Redis CPU per claim (µs)", "redis_cpu_us_per_claim"),
    ("fill (jobs/s)", "enqueue_jobs_per_s"),
)


def run_claim(args: argparse.Namespace) -> int:
    redis_server = RedisServer().start()

    async def measure() -> list[dict[str, float]]:
        redis = Redis.from_url(redis_server.url)
        try:
            return [
                await measure_claims(redis, size, args.claims)
                for _ in range(args.rounds)
                for size in args.sizes
            ]
        finally:
            await redis.aclose()

    try:
        rows = asyncio.run(measure())
    finally:
        redis_server.stop()
    print(
        f"{args.claims} claim rounds per size and round (claims of {FREE_SLOTS} among the "
        f"first {READ_LIMIT} due), {args.rounds} rounds alternating sizes; "
        f"median [min-max] over the rounds; cores: {os.cpu_count()}\n"
    )
    print("| queued jobs | " + " | ".join(label for label, _ in CLAIM_COLUMNS) + " |")
    print("|---|" + "---|" * len(CLAIM_COLUMNS))
    for size in args.sizes:
        mine = [row for row in rows if row["size"] == size]
        cells = [
            spread([row[key] for row in mine], 0 if "fill" in label else 1)
            for label, key in CLAIM_COLUMNS
        ]
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    taken = sorted({round(row["jobs_per_claim"], 2) for row in rows})
    print(f"\njobs taken per claim: {', '.join(map(str, taken))} (of {FREE_SLOTS} wanted)")
    write_out(args.out, "claim", args, rounds=rows)
    return 0


# --- fairness ----------------------------------------------------------------------------------

FAIR_WEIGHTS = {"a": 3.0, "b": 1.0, "c": 1.0}  # c: the default weight, 1
FEED_INTERVAL_S = 0.2


@dataclass
class Ran:
    tenant: str
    started_s: float
    ended_s: float
    queued_ms: float


class Feeder:
    """Keeps about ``backlog`` jobs of each of ``tenants`` queued."""

    def __init__(self, client: ChatClient, backlog: int, max_tokens: int) -> None:
        self.client, self.backlog, self.max_tokens = client, backlog, max_tokens
        self.tenants: list[str] = []
        self.jobs: list[Submitted] = []
        self.seen: list[tuple[float, dict[str, int]]] = []  # (when, queued per tenant) per pass
        self.stop = asyncio.Event()

    async def submit(self, tenant: str, count: int) -> list[Submitted]:
        async def one(index: int) -> Submitted:
            text = f"job {index} of {tenant}"
            return await submit_unread(
                self.client, text, tenant=tenant, max_tokens=self.max_tokens, seed=8
            )

        jobs = await in_chunks(one, range(len(self.jobs), len(self.jobs) + count))
        self.jobs += jobs
        return jobs

    async def run(self) -> None:
        while not self.stop.is_set():
            queued = await queued_by_tenant(self.client.redis, QUEUE)
            self.seen.append((time.time(), queued))
            missing = {tenant: self.backlog - queued.get(tenant, 0) for tenant in self.tenants}
            await asyncio.gather(*(self.submit(t, n) for t, n in missing.items() if n > 0))
            try:
                await asyncio.wait_for(self.stop.wait(), FEED_INTERVAL_S)
            except TimeoutError:
                pass

    async def cancel_queued(self) -> None:
        """Cancel the jobs no worker has claimed yet (a claim drops them from tenant-of)."""
        queued = [raw.decode() for raw in await self.client.redis.hkeys(tenant_of_key(QUEUE))]
        await in_chunks(self.client.cancel, queued)


async def what_ran(client: ChatClient, jobs: Sequence[Submitted]) -> list[Ran]:
    events = await in_chunks(partial(finished_with, client.redis), [job.job_id for job in jobs])
    return [
        Ran(
            job.tenant,
            job.enqueued_s + event.timings.queued_ms / 1000,
            job.enqueued_s + event.timings.total_ms / 1000,
            event.timings.queued_ms,
        )
        for job, event in zip(jobs, events, strict=True)
        if isinstance(event, DoneEvent)
    ]


async def measure_fairness(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with ChatClient(redis_url=url, queue=QUEUE, max_queue=0) as client:
        await client.chat("warm up", max_tokens=4)
        feeder = Feeder(client, args.backlog, args.max_tokens)
        feeder.tenants += ["a", "b"]
        feeding = asyncio.create_task(feeder.run())
        await asyncio.sleep(args.warmup)
        window = (time.time(), time.time() + args.seconds)
        await asyncio.sleep(args.seconds)
        (c_first_job,) = await feeder.submit("c", 1)  # c arrives: its first job, then the rest
        c_arrived_s = c_first_job.enqueued_s
        await feeder.submit("c", args.backlog - 1)
        feeder.tenants.append("c")
        await asyncio.sleep(args.after_c_s)
        feeder.stop.set()
        await feeding
        await feeder.cancel_queued()
        await wait_idle(client)
        ran = await what_ran(client, feeder.jobs)
    starts = sorted(ran, key=lambda job: job.started_s)
    in_window = [job for job in ran if window[0] <= job.ended_s < window[1]]
    started = [job for job in starts if window[0] <= job.started_s < window[1]]
    c_first = next((job for job in starts if job.tenant == "c"), None)
    c_started_s = c_first.started_s if c_first is not None else float("inf")
    before_c = [job for job in starts if c_arrived_s <= job.started_s < c_started_s]
    after_c = [job for job in starts if job.started_s >= c_started_s][: args.after_c]
    done = Counter(job.tenant for job in in_window)
    gaps = [(b.started_s - a.started_s) * 1000 for a, b in itertools.pairwise(started)]
    return {
        "window_s": args.seconds,
        "completed": dict(done),
        "started": dict(Counter(job.tenant for job in started)),
        "queued_ms_p50": {
            tenant: statistics.median(job.queued_ms for job in in_window if job.tenant == tenant)
            for tenant in done
        },
        "queued_ms_max": {
            tenant: max(job.queued_ms for job in in_window if job.tenant == tenant)
            for tenant in done
        },
        "ratio_a_b": done["a"] / done["b"] if done["b"] else None,
        "feeder_pass_s_max": max(
            (b[0] - a[0] for a, b in itertools.pairwise(feeder.seen)), default=0.0
        ),
        # A tenant whose backlog ran dry in the window leaves its share to the others.
        "lowest_backlog": {
            tenant: min(
                (
                    queued.get(tenant, 0)
                    for at, queued in feeder.seen
                    if window[0] <= at < window[1]
                ),
                default=0,
            )
            for tenant in ("a", "b")
        },
        "start_gap_ms": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
        "starts_before_c": len(before_c),
        "before_c_by_tenant": dict(Counter(job.tenant for job in before_c)),
        "c_first_queued_ms": None if c_first is None else c_first.queued_ms,
        # The first starts from c's arrival on: (tenant, ms after c's first enqueue).
        "starts_from_c_arrival": [
            (job.tenant, round((job.started_s - c_arrived_s) * 1000, 3))
            for job in starts
            if job.started_s >= c_arrived_s
        ][:12],
        "after_c_starts": len(after_c),
        "after_c_by_tenant": dict(Counter(job.tenant for job in after_c)),
        "submitted": len(feeder.jobs),
        "finished": len(ran),
    }


def run_fairness(args: argparse.Namespace) -> int:
    env = {"EDGEQ_TENANT_WEIGHTS": "a=3,b=1"}
    with tiny_worker(env, "fairness") as (redis_server, worker, _):
        max_jobs, reserved = worker_slots(worker)
        figures = asyncio.run(measure_fairness(redis_server.url, args))
    aging_s = float(os.environ.get("EDGEQ_PRIORITY_AGING_S", "60"))
    print(
        f"EDGEQ_TENANT_WEIGHTS=a=3,b=1; ~{args.backlog} jobs of each tenant kept queued, "
        f"max_tokens {args.max_tokens}, default class; worker: {max_jobs} jobs, "
        f"{reserved} of them kept from batch jobs; aging {aging_s:g} s\n"
    )
    print(f"over {args.seconds:g} s after {args.warmup:g} s of warm-up:\n")
    print("| tenant | weight | jobs finished | jobs started | queue wait p50 (s) | max (s) |")
    print("|---|---|---|---|---|---|")
    for tenant in ("a", "b"):
        print(
            f"| {tenant} | {FAIR_WEIGHTS[tenant]:g} | {figures['completed'].get(tenant, 0)} | "
            f"{figures['started'].get(tenant, 0)} | "
            f"{figures['queued_ms_p50'].get(tenant, 0) / 1000:.1f} | "
            f"{figures['queued_ms_max'].get(tenant, 0) / 1000:.1f} |"
        )
    ratio = figures["ratio_a_b"]
    if ratio is not None:
        deviation = (ratio / 3 - 1) * 100
        print(f"\na:b finished = {ratio:.3f} : 1 (weights 3 : 1; deviation {deviation:+.1f} %)")
    lowest = figures["lowest_backlog"]
    print(f"lowest backlog the feeder saw in the window: a {lowest['a']}, b {lowest['b']}")
    if not all(lowest.values()):
        print("  (a backlog ran dry: that tenant's share went to the other, not by weight)")
    if max(figures["queued_ms_max"].values(), default=0) > aging_s * 1000 > 0:
        print(f"  (some jobs waited over the aging time, {aging_s:g} s: aged jobs move up a class)")
    gaps = figures["start_gap_ms"]
    if figures["c_first_queued_ms"] is None:
        print(f"\ntenant c arrived with {args.backlog} jobs: none of them started")
    else:
        by = ", ".join(f"{t}: {n}" for t, n in sorted(figures["before_c_by_tenant"].items()))
        print(
            f"\ntenant c arrives with {args.backlog} jobs: {figures['starts_before_c']} job "
            f"starts between its arrival and its first job's start ({by or 'none'}); its first "
            f"job waited {figures['c_first_queued_ms']:.1f} ms (gaps between consecutive starts "
            f"in the window: p50 {gaps['p50']:.1f} ms, p99 {gaps['p99']:.1f} ms)"
        )
    after, total = figures["after_c_by_tenant"], max(1, figures["after_c_starts"])
    shares = ", ".join(
        f"{t}: {after.get(t, 0)} ({after.get(t, 0) / total * 100:.0f} %, by weight "
        f"{weight / sum(FAIR_WEIGHTS.values()) * 100:.0f} %)"
        for t, weight in FAIR_WEIGHTS.items()
    )
    print(f"the {figures['after_c_starts']} starts from c's first on: {shares}")
    write_out(args.out, "fairness", args, **figures)
    return 0


# --- interference ------------------------------------------------------------------------------


def rotated(request: BenchRequest, by: int) -> list[ChatMessage]:
    """The request's message with its words rotated: the same tokens, another prefix."""
    (message,) = request.messages
    lead, *words = message.content.split(" ")
    by %= max(1, len(words))
    return [message.model_copy(update={"content": " ".join([lead, *words[by:], *words[:by]])})]


async def one_user(
    client: ChatClient, workload: Workload, request: BenchRequest, run: int
) -> tuple[float, int]:
    """(client TTFT in ms, answer tokens) of one interactive chat."""
    began = time.perf_counter()
    job = await client.submit(
        rotated(request, run), priority="interactive", **workload.sampling_fields(request)
    )
    first: float | None = None
    async for event in job.stream():
        if isinstance(event, DeltaEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"interactive job {job.job_id} failed: {event.code} {event.message}")
        elif isinstance(event, DoneEvent):  # an answer of no text: its first token was the end
            return ((first or time.perf_counter()) - began) * 1000, event.usage.completion_tokens
    raise AssertionError("the stream ended without a terminal event")


@dataclass
class BurstRun:
    mode: str
    ttft_ms: list[float]
    answer_tokens: int
    seconds: float
    batch_tok_s_before: float | None = None  # batch alone, between busy and the burst
    batch_tok_s_during: float | None = None
    batch_tok_s_overall: float | None = None
    batch_running: float | None = None  # jobs the worker ran as the burst began

    @property
    def p50(self) -> float:
        return statistics.median(self.ttft_ms)

    @property
    def p99(self) -> float:
        return percentile(self.ttft_ms, 0.99)


async def burst(client: ChatClient, workload: Workload, run: int, mode: str) -> BurstRun:
    began = time.perf_counter()
    chats = await asyncio.gather(*(one_user(client, workload, r, run) for r in workload.requests))
    return BurstRun(
        mode, [ttft for ttft, _ in chats], sum(n for _, n in chats), time.perf_counter() - began
    )


async def submit_batch(
    client: ChatClient, workload: Workload, run: int, request: BenchRequest
) -> Submitted:
    messages = rotated(request, run)
    fields = workload.sampling_fields(request)
    return await submit_unread(client, messages, priority="batch", tenant="nightly", **fields)


async def wait_running(
    worker: WorkerProcess, enough: Callable[[float], bool], timeout_s: float = 300.0
) -> float:
    """Until the worker's count of running jobs is ``enough``; that count."""
    deadline = time.monotonic() + timeout_s
    while not enough(running := (await scrape(worker))["edgeq:num_requests_running"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker still runs {running:g} jobs after {timeout_s:g} s")
        await asyncio.sleep(0.2)
    return running


async def measure_interference(
    url: str, worker: WorkerProcess, model: Path, args: argparse.Namespace
) -> list[tuple[BurstRun, BurstRun]]:
    def workload(requests: int, max_tokens: int, seed: int) -> Workload:
        spec = WorkloadSpec(requests, 64, 256, max_tokens, temperature=0.5, top_p=0.9, seed=seed)
        return build_workload(spec, tokenizer, str(model))

    tokenizer = load_tokenizer(str(model))
    users = workload(args.users, args.max_tokens, 0)  # bench's defaults: the seed's workload
    batch = workload(args.batch_jobs, args.batch_max_tokens, 1)
    max_jobs, reserved = worker_slots(worker)
    busy = min(args.batch_jobs, max_jobs - reserved)
    rounds: list[tuple[BurstRun, BurstRun]] = []
    async with ChatClient(redis_url=url, queue=QUEUE, max_queue=0) as client:
        await client.chat("warm up", max_tokens=4)
        for index in range(args.rounds):
            await asyncio.sleep(1.0)
            idle = await burst(client, users, 2 * index, "idle")
            await asyncio.sleep(1.0)
            tokens_0, queued_at = await scrape(worker), time.perf_counter()
            jobs = await in_chunks(partial(submit_batch, client, batch, index), batch.requests)
            await wait_running(worker, lambda n: n >= busy)
            tokens_busy, busy_at = await scrape(worker), time.perf_counter()
            await asyncio.sleep(args.settle)
            tokens_1, burst_at = await scrape(worker), time.perf_counter()
            loaded = await burst(client, users, 2 * index + 1, "loaded")
            tokens_2, ended_at = await scrape(worker), time.perf_counter()
            name = "edgeq:generation_tokens_total"
            batch_before = tokens_1[name] - tokens_busy[name]
            loaded.batch_tok_s_before = batch_before / (burst_at - busy_at)
            batch_during = tokens_2[name] - tokens_1[name] - loaded.answer_tokens
            loaded.batch_tok_s_during = batch_during / (ended_at - burst_at)
            batch_overall = tokens_2[name] - tokens_0[name] - loaded.answer_tokens
            loaded.batch_tok_s_overall = batch_overall / (ended_at - queued_at)
            loaded.batch_running = tokens_1["edgeq:num_requests_running"]
            await in_chunks(client.cancel, [job.job_id for job in jobs])
            await wait_idle(client)  # a cancel takes the job out of the queue at once, and
            await wait_running(worker, lambda n: n == 0)  # a running one stops soon after
            rounds.append((idle, loaded))
            print(
                f"round {index + 1}: TTFT p50 idle {idle.p50:.1f} ms, loaded {loaded.p50:.1f} ms",
                file=sys.stderr,
            )
    return rounds


def run_interference(args: argparse.Namespace) -> int:
    with tiny_worker({}, "interference") as (redis_server, worker, model):
        max_jobs, reserved = worker_slots(worker)
        rounds = asyncio.run(measure_interference(redis_server.url, worker, model, args))
    scheduling = os.environ.get("EDGEQ_ENGINE_SCHEDULING", "priority")
    ran = sorted({f"{loaded.batch_running:g}" for _, loaded in rounds})
    slowest = f" (p99 of {args.users} users: the slowest one)" if args.users <= 51 else ""
    print(
        f"{args.users} interactive users at once (prompts 64-256 tokens, max_tokens "
        f"{args.max_tokens}); loaded: after {args.batch_jobs} batch jobs (max_tokens "
        f"{args.batch_max_tokens}) were queued and the worker ran {' or '.join(ran)} of them "
        f"({max_jobs} jobs, {reserved} slots reserved from batch, engine scheduling "
        f"{scheduling}), "
        f"{args.settle:g} s on; client TTFT{slowest}, median [min-max] over {args.rounds} "
        f"rounds\n"
    )
    print("| | TTFT p50 (ms) | TTFT p99 (ms) | burst (s) |")
    print("|---|---|---|---|")
    for position, mode in enumerate(("idle", "loaded")):
        runs = [pair[position] for pair in rounds]
        print(
            f"| {mode} | {spread([run.p50 for run in runs])} | {spread([run.p99 for run in runs])} "
            f"| {spread([run.seconds for run in runs], 2)} |"
        )
    p50s = [loaded.p50 / idle.p50 for idle, loaded in rounds]
    p99s = [loaded.p99 / idle.p99 for idle, loaded in rounds]
    print(
        f"| loaded / idle, per round | {spread(p50s, 2)} | {spread(p99s, 2)} | |\n\n"
        f"target: loaded / idle <= 1.3; per round p50: {', '.join(f'{r:.2f}' for r in p50s)}, "
        f"p99: {', '.join(f'{r:.2f}' for r in p99s)}"
    )
    before = [loaded.batch_tok_s_before or 0.0 for _, loaded in rounds]
    during = [loaded.batch_tok_s_during or 0.0 for _, loaded in rounds]
    overall = [loaded.batch_tok_s_overall or 0.0 for _, loaded in rounds]
    print(
        f"batch output (tok/s): {spread(before, 0)} alone in the {args.settle:g} s before the "
        f"burst, {spread(during, 0)} during it, {spread(overall, 0)} overall (queued -> burst end)"
    )
    pairs = [{"idle": asdict(idle), "loaded": asdict(loaded)} for idle, loaded in rounds]
    write_out(args.out, "interference", args, rounds=pairs)
    return 0


# --- command line ------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    claim = commands.add_parser("claim", help="claim latency and Redis CPU vs queue length")
    claim.add_argument("--sizes", type=int_list, default=[100, 100_000], metavar="N,N")
    claim.add_argument("--rounds", type=int, default=3)
    claim.add_argument("--claims", type=int, default=2000, help="claim rounds per size and round")
    claim.set_defaults(run=run_claim)
    fair = commands.add_parser("fairness", help="tenants' shares under a real worker")
    fair.add_argument("--backlog", type=int, default=500, help="jobs kept queued per tenant")
    fair.add_argument("--seconds", type=float, default=60.0, help="the counting window")
    fair.add_argument("--warmup", type=float, default=5.0)
    fair.add_argument("--max-tokens", type=int, default=8)
    fair.add_argument("--after-c-s", type=float, default=10.0, help="run on after c arrives")
    fair.add_argument("--after-c", type=int, default=100, help="starts to count c's share over")
    fair.set_defaults(run=run_fairness)
    inter = commands.add_parser("interference", help="interactive TTFT with a batch backlog")
    inter.add_argument("--users", type=int, default=50)
    inter.add_argument("--max-tokens", type=int, default=256)
    inter.add_argument("--batch-jobs", type=int, default=2000)
    inter.add_argument("--batch-max-tokens", type=int, default=256)
    inter.add_argument("--rounds", type=int, default=3)
    inter.add_argument("--settle", type=float, default=5.0, help="s between busy and the burst")
    inter.set_defaults(run=run_interference)
    for sub in (claim, fair, inter):
        sub.add_argument("--out", type=Path, help="write the raw figures here (JSON)")
    args = parser.parse_args()
    result: int = args.run(args)
    return result


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
