"""``edgeq capacity``: what one Redis carries when boxes stream at a GPU's rate.

For each configuration (a number of boxes, a stream interval) this starts a private
redis-server, that many ``edgeq simulate-box`` workers (edgeq's real worker around an engine
that makes tokens at a GPU's rate, edgeq.bench.simulate) and one subscriber process per box
whose users keep ``streams`` chats in flight through ``ChatClient``, each submitting its next
chat when one ends. After a warm-up it measures a window:

- from Redis (``INFO`` at the window's start and end): events/s (the PUBLISH calls the publish
  script makes), Redis CPU % and CPU µs per event, connections, memory;
- from the subscribers: tokens delivered against the tokens the simulated GPUs were asked to
  make, and token → subscriber latency (the last stamp in each delta, edgeq.bench.simulate);
- from ``/proc/stat``: the machine's CPU, so a run the machine could not carry is told apart
  from one Redis could not.

Rounds alternate the configurations, as ``edgeq bench --rounds`` does, and each figure is
reported as the median [min-max] over the rounds.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis

from edgeq.bench.cpu import process_cpu_s
from edgeq.bench.gpu_rate import GpuRate, worker_process
from edgeq.core.keys import events_key
from edgeq.core.protocol import DeltaEvent, ErrorEvent
from edgeq.core.tasks import cancel_and_wait
from edgeq.testing.processes import RedisServer, WorkerProcess

QUEUE = "edgeq:capacity"
PROMPT = "Tell me about the sea."
#: How long a box may take to import the worker (vLLM's Python side) and report ready.
BOX_READY_TIMEOUT_S = 180.0
#: Replay streams sampled after the window for the memory one event takes.
MEMORY_SAMPLE_KEYS = 50
#: Subscriber results later than this after the window ends are a failed run.
RESULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CapacityPlan:
    boxes: Sequence[int]
    interval_ms: Sequence[float]
    streams: int  # chats in flight per box (its batch)
    step_ms: float
    prefill_ms: float
    max_tokens: int
    warmup_s: float
    window_s: float
    rounds: int
    #: Boxes run vLLM's own output processing on the model's tokenizer (edgeq.bench.vllm_output)
    #: instead of the stand-in that skips it; ``model`` is that tokenizer's model directory.
    vllm_output: bool = False
    model: str | None = None

    def configurations(self) -> list[tuple[int, float]]:
        return [(boxes, interval) for interval in self.interval_ms for boxes in self.boxes]

    def planned_tokens_per_s(self, boxes: int) -> float:
        """What the simulated GPUs make with every stream decoding (prefill gaps aside)."""
        return boxes * self.streams * 1000 / self.step_ms


@dataclass
class SubscriberReport:
    deltas: int
    terminals: int
    #: What went wrong, by error event code or by the client's exception class.
    errors: dict[str, int]
    tokens: int
    latencies_s: list[float]

    def failed(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


@dataclass
class CapacityRow:
    boxes: int
    interval_ms: float
    round: int
    events_per_s: float
    redis_cpu_percent: float
    redis_cpu_us_per_event: float
    machine_cpu_percent: float
    box_cpu_percent: float  # the busiest box's process (100 = one core)
    box_cpu_us_per_token: float  # all boxes' CPU over the tokens the subscribers got
    subscriber_cpu_percent: float  # the busiest subscriber process
    connections: int
    memory_mb: float
    replay_bytes_per_event: float
    planned_tokens_per_s: float
    delivered_tokens_per_s: float
    delivered_fraction: float
    latency_p50_ms: float
    latency_p99_ms: float
    errors: int
    error_kinds: dict[str, int]


def _last_stamp(text: str) -> float:
    """The time the newest token of a delta was made (its last stamp, edgeq.bench.simulate)."""
    return float(text.rstrip().rsplit(" ", 1)[-1])


#: The marks edgeq.bench.vllm_output appends to each output's real text: ``|tokens@made|``.
MARK = re.compile(r"\|(\d+)@(\d+\.\d+)\|")


def delta_tokens(text: str) -> tuple[int, float]:
    """A delta's tokens and the time its newest was made, from either stand-in's text: marks
    (vLLM's output processing) or one stamp per output after "x " per token."""
    marks = MARK.findall(text)
    if marks:
        return sum(int(tokens) for tokens, _ in marks), float(marks[-1][1])
    return text.count(" "), _last_stamp(text)


@dataclass(frozen=True)
class SubscriberPlan:
    """What one subscriber process does: ``users`` chats in flight, each submitting its next
    when one ends, counted within the window (Unix times)."""

    redis_url: str
    users: int
    max_tokens: int
    chat_s: float  # one chat's duration at the simulated rate: the users start spread over it
    window: tuple[float, float]
    max_in_flight: int  # the queue cap the subscriber sets, so no box's batch is refused


async def _follow(plan: SubscriberPlan) -> SubscriberReport:
    from edgeq.producer.client import ChatClient

    report = SubscriberReport(deltas=0, terminals=0, errors={}, tokens=0, latencies_s=[])
    start, end = plan.window

    async def user() -> None:
        await asyncio.sleep(random.uniform(0, plan.chat_s))
        while time.time() < end:
            job = await client.submit(PROMPT, max_tokens=plan.max_tokens)
            async for event in job.stream():
                now = time.time()
                if not start <= now < end:
                    continue
                if isinstance(event, DeltaEvent):
                    tokens, made_s = delta_tokens(event.text)
                    report.deltas += 1
                    report.tokens += tokens
                    report.latencies_s.append(now - made_s)
                else:
                    report.terminals += 1
                    if isinstance(event, ErrorEvent):
                        report.failed(event.code)

    async with ChatClient.from_url(
        plan.redis_url, queue=QUEUE, max_queue=plan.max_in_flight
    ) as client:
        tasks = [asyncio.create_task(user()) for _ in range(plan.users)]
        await asyncio.sleep(max(0.0, end - time.time()))
        await cancel_and_wait(*tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            report.failed(type(result).__name__)
    return report


def follow_streams(plan: SubscriberPlan, out: Connection) -> None:
    """A subscriber process: its plan's chats in flight until the window ends."""
    out.send(asdict(asyncio.run(_follow(plan))))
    out.close()


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as stat:
        fields = [float(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busiest_percent(before: Sequence[float], after: Sequence[float], seconds: float) -> float:
    return round(100 * max(b - a for a, b in zip(before, after, strict=True)) / seconds, 1)


def _redis_cpu_s(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _publishes(info: dict[str, Any]) -> int:
    stats = info.get("cmdstat_publish") or {}
    return int(stats.get("calls", 0))


def _replay_bytes_per_event(client: redis.Redis) -> float:
    """Memory of a sample of replay streams over the events they hold."""
    used = events = sampled = 0
    for key in client.scan_iter(match=events_key("*"), count=1000):
        used += int(client.memory_usage(key) or 0)
        events += int(client.xlen(key))
        sampled += 1
        if sampled >= MEMORY_SAMPLE_KEYS:
            break
    return used / events if events else 0.0


def _merged(counts: Sequence[dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for count in counts:
        for what, times in count.items():
            merged[what] = merged.get(what, 0) + times
    return merged


def _percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _box(plan: CapacityPlan, env: dict[str, str], log: Path, gpu: GpuRate) -> WorkerProcess:
    """A simulated box, not started: with ``vllm_output``, AsyncLLM's real output processing on
    the model's tokenizer around the simulated core."""
    if not plan.vllm_output:
        return worker_process(env, log, gpu)
    env = {**env, "EDGEQ_MODEL": str(plan.model)}
    return WorkerProcess(
        env, log, command="simulate-box", args=(*gpu.box_args(), "--vllm-output")
    )


def measure_configuration(
    plan: CapacityPlan, boxes: int, interval_ms: float, round_: int, scratch: Path
) -> CapacityRow:
    """One configuration on a fresh Redis and fresh boxes."""
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    workers: list[WorkerProcess] = []
    subscribers: list[tuple[Any, Connection]] = []
    try:
        baseline_memory = int(client.info("memory")["used_memory"])
        env = {
            "EDGEQ_REDIS_URL": server.url,
            "EDGEQ_QUEUE": QUEUE,
            "EDGEQ_MAX_NUM_SEQS": str(plan.streams),
            "EDGEQ_STREAM_INTERVAL_MS": f"{interval_ms:g}",
            "EDGEQ_METRICS_PORT": "0",
            "EDGEQ_DRAIN_TIMEOUT_S": "1",
            "EDGEQ_LOG_LEVEL": "warning",
        }
        gpu = GpuRate(step_ms=plan.step_ms, prefill_ms=plan.prefill_ms)
        for n in range(boxes):
            log = scratch / f"round{round_}-boxes{boxes}-i{interval_ms:g}-box{n}.log"
            worker = _box(plan, env, log, gpu)
            workers.append(worker.start())
        for worker in workers:
            worker.wait_ready(BOX_READY_TIMEOUT_S)
        chat_s = (plan.prefill_ms + plan.max_tokens * plan.step_ms) / 1000
        start = time.time() + plan.warmup_s
        window = (start, start + plan.window_s)
        context = multiprocessing.get_context("spawn")
        for _ in range(boxes):
            receive, send = context.Pipe(duplex=False)
            subscriber = SubscriberPlan(
                redis_url=server.url,
                users=plan.streams,
                max_tokens=plan.max_tokens,
                chat_s=chat_s,
                window=window,
                # Every box's batch may be in flight at once: the cap must not refuse them.
                max_in_flight=2 * boxes * plan.streams,
            )
            process = context.Process(target=follow_streams, args=(subscriber, send))
            process.start()
            subscribers.append((process, receive))
        box_pids = [worker.process.pid for worker in workers if worker.process is not None]
        subscriber_pids = [process.pid for process, _ in subscribers]

        def process_cpu() -> tuple[list[float], list[float]]:
            return [process_cpu_s(pid) for pid in box_pids], [
                process_cpu_s(pid) for pid in subscriber_pids
            ]

        time.sleep(max(0.0, window[0] - time.time()))
        before, busy_before, cpu_before = client.info("all"), _cpu_busy(), process_cpu()
        time.sleep(max(0.0, window[1] - time.time()))
        after, busy_after, cpu_after = client.info("all"), _cpu_busy(), process_cpu()
        reports = [
            SubscriberReport(**receive.recv())
            for _, receive in subscribers
            if receive.poll(RESULT_TIMEOUT_S)
        ]
        if len(reports) < boxes:
            raise RuntimeError(f"{boxes - len(reports)} subscriber process(es) sent no report")
        events = _publishes(after) - _publishes(before)
        redis_cpu_s = _redis_cpu_s(after) - _redis_cpu_s(before)
        latencies = [value for report in reports for value in report.latencies_s]
        delivered = sum(report.tokens for report in reports) / plan.window_s
        box_cpu_s = sum(cpu_after[0]) - sum(cpu_before[0])
        planned = plan.planned_tokens_per_s(boxes)
        return CapacityRow(
            boxes=boxes,
            interval_ms=interval_ms,
            round=round_,
            events_per_s=round(events / plan.window_s, 1),
            redis_cpu_percent=round(100 * redis_cpu_s / plan.window_s, 1),
            redis_cpu_us_per_event=round(1e6 * redis_cpu_s / events, 2) if events else 0.0,
            machine_cpu_percent=round(
                100 * (busy_after[0] - busy_before[0]) / (busy_after[1] - busy_before[1]), 1
            ),
            box_cpu_percent=_busiest_percent(cpu_before[0], cpu_after[0], plan.window_s),
            box_cpu_us_per_token=round(1e6 * box_cpu_s / (delivered * plan.window_s), 2)
            if delivered
            else 0.0,
            subscriber_cpu_percent=_busiest_percent(cpu_before[1], cpu_after[1], plan.window_s),
            connections=int(after["connected_clients"]),
            memory_mb=round((int(after["used_memory"]) - baseline_memory) / 2**20, 1),
            replay_bytes_per_event=round(_replay_bytes_per_event(client), 1),
            planned_tokens_per_s=round(planned, 1),
            delivered_tokens_per_s=round(delivered, 1),
            delivered_fraction=round(delivered / planned, 3),
            latency_p50_ms=round(1000 * _percentile(latencies, 0.50), 2),
            latency_p99_ms=round(1000 * _percentile(latencies, 0.99), 2),
            errors=sum(sum(report.errors.values()) for report in reports),
            error_kinds=_merged([report.errors for report in reports]),
        )
    finally:
        for process, _ in subscribers:
            process.join(timeout=RESULT_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        for worker in workers:
            worker.stop()
        client.close()
        server.stop()


FIGURES: tuple[tuple[str, str], ...] = (
    ("events_per_s", "events/s"),
    ("redis_cpu_percent", "Redis CPU %"),
    ("redis_cpu_us_per_event", "Redis CPU µs/event"),
    ("machine_cpu_percent", "machine CPU %"),
    ("box_cpu_percent", "busiest box CPU %"),
    ("box_cpu_us_per_token", "box CPU µs/token"),
    ("subscriber_cpu_percent", "busiest subscriber CPU %"),
    ("connections", "connections"),
    ("memory_mb", "Redis memory MB"),
    ("replay_bytes_per_event", "replay bytes/event"),
    ("delivered_tokens_per_s", "tokens/s delivered"),
    ("delivered_fraction", "delivered / planned"),
    ("latency_p50_ms", "token→subscriber p50 ms"),
    ("latency_p99_ms", "token→subscriber p99 ms"),
    ("errors", "error events"),
)


def summarise(rows: Sequence[CapacityRow]) -> dict[tuple[int, float], dict[str, list[float]]]:
    """Per configuration, each figure's values over the rounds."""
    summary: dict[tuple[int, float], dict[str, list[float]]] = {}
    for row in rows:
        figures = summary.setdefault((row.boxes, row.interval_ms), {})
        for name, _ in FIGURES:
            figures.setdefault(name, []).append(float(getattr(row, name)))
    return summary


def _median_range(values: Sequence[float]) -> str:
    def short(value: float) -> str:
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"

    median = statistics.median(values)
    if len(values) == 1:
        return short(median)
    return f"{short(median)} [{short(min(values))}-{short(max(values))}]"


def format_summary(plan: CapacityPlan, rows: Sequence[CapacityRow]) -> str:
    summary = summarise(rows)
    configurations = sorted(summary)
    header = [
        "figure",
        *(f"{boxes} box(es), {interval:g} ms" for boxes, interval in configurations),
    ]
    lines = [
        ("boxes with vLLM's output processing on the model's tokenizer, " if plan.vllm_output
         else "")
        + f"{plan.streams} streams/box, {plan.step_ms:g} ms/step, first token after "
        f"{plan.prefill_ms:g} ms, {plan.max_tokens} tokens/chat, window {plan.window_s:g} s, "
        f"{plan.rounds} round(s): median [min-max]",
        " | ".join(header),
        " | ".join("---" for _ in header),
    ]
    for name, label in FIGURES:
        cells = [_median_range(summary[config][name]) for config in configurations]
        lines.append(" | ".join([label, *cells]))
    return "\n".join(lines)


def run_capacity(
    plan: CapacityPlan, *, say: Callable[[str], None], scratch: Path | None = None
) -> list[CapacityRow]:
    rows: list[CapacityRow] = []
    with tempfile.TemporaryDirectory(prefix="edgeq-capacity-") as temporary:
        logs = scratch or Path(temporary)
        for round_ in range(1, plan.rounds + 1):
            for boxes, interval in plan.configurations():
                say(f"round {round_}/{plan.rounds}: {boxes} box(es), interval {interval:g} ms")
                row = measure_configuration(plan, boxes, interval, round_, logs)
                say(
                    f"  {row.events_per_s:,.0f} events/s, Redis {row.redis_cpu_percent:g} % "
                    f"({row.redis_cpu_us_per_event:g} µs/event), delivered "
                    f"{row.delivered_fraction:.0%}, p99 {row.latency_p99_ms:g} ms"
                    + (f", errors {row.error_kinds}" if row.errors else "")
                )
                rows.append(row)
    return rows


def run_capacity_command(args: Any) -> int:
    plan = CapacityPlan(
        boxes=args.boxes,
        interval_ms=args.interval_ms,
        streams=args.streams,
        step_ms=args.step_ms,
        prefill_ms=args.prefill_ms,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
        rounds=args.rounds,
        vllm_output=args.vllm_output,
        model=str(args.model) if args.model else None,
    )

    def say(message: str) -> None:
        print(f"edgeq capacity: {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="edgeq-capacity-model-") as models:
        if plan.vllm_output and plan.model is None:
            # Its tokenizer is what the boxes' detokenizer runs; the weights are never loaded.
            from edgeq.testing.tiny_model import make_tiny_model

            plan = replace(plan, model=str(make_tiny_model(Path(models) / "tiny").directory))
        rows = run_capacity(plan, say=say, scratch=args.logs)
    print(format_summary(plan, rows))
    if args.out:
        args.out.write_text(
            json.dumps({"plan": asdict(plan), "rows": [asdict(row) for row in rows]}, indent=2)
        )
    return 1 if any(row.errors for row in rows) else 0
