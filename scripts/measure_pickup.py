"""The queue's own cost: pickup latency with 0, 64 and 256 chats in flight and for bursts of
64 chats submitted at once, idle CPU of the worker, and how many stream events per second the
publish path sustains.

    .venv/bin/python scripts/measure_pickup.py [--before] [--probes 30] [--bursts 5]

Pickup is the worker's own `queued_ms` (enqueue → the chat job starts), to the microsecond.
`--before` runs the worker with EDGEQ_FAST_PICKUP=false: arq's own polling (every
EDGEQ_POLL_DELAY_MS=10 ms), its per-poll re-check of every running job and its one-job-at-a-time
claim. The worker inherits this script's environment, PYTHONPATH included, so an older
checkout's worker can be measured with it: run it from outside any checkout (the worker's
`python -m` puts the current directory first), e.g.

    cd /tmp && PYTHONPATH=/path/to/old-worktree /path/to/.venv/bin/python \
        /path/to/edgeq/scripts/measure_pickup.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgeq.core.events import EventLog
from edgeq.core.protocol import DeltaEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model

QUEUE = "edgeq:pickup"
IN_FLIGHT = (0, 64, 256)
BURST = 64
BURST_TOKENS = 128  # the first chats of a burst stream while the last ones are taken
HOLD_TOKENS = 480  # long enough that the in-flight chats outlast the probes
IDLE_SAMPLE_S = 10.0
PUBLISHERS, EVENTS_EACH = 64, 500
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def pickup_ms(client: ChatClient, probes: int) -> list[float]:
    samples = []
    for index in range(probes):
        result = await client.chat(f"probe {index}", max_tokens=1)
        samples.append(result.timings.queued_ms)
        await asyncio.sleep(0.05)  # let the worker settle back into its wait
    return samples


async def measure_pickup(client: ChatClient, probes: int) -> dict[int, list[float]]:
    figures: dict[int, list[float]] = {}
    for in_flight in IN_FLIGHT:
        holders = [
            await client.submit(f"hold {i}", max_tokens=HOLD_TOKENS, seed=8)
            for i in range(in_flight)
        ]
        for job in holders[-1:]:  # the last one generating means all were picked up
            async for event in job.stream():
                if isinstance(event, DeltaEvent):
                    break
        figures[in_flight] = await pickup_ms(client, probes)
        for job in holders:
            await client.cancel(job.job_id)
            await job.aclose()
        while await client.queue.depth():  # noqa: ASYNC110 (state lives in Redis)
            await asyncio.sleep(0.2)
    return figures


async def measure_bursts(client: ChatClient, bursts: int) -> list[float]:
    """Pickup of every chat in ``bursts`` bursts of BURST chats submitted at once."""
    samples: list[float] = []
    for index in range(bursts):
        jobs = await asyncio.gather(
            *(client.submit(f"burst {index}.{n}", max_tokens=BURST_TOKENS) for n in range(BURST))
        )
        results = await asyncio.gather(*(job.result() for job in jobs))
        samples += [result.timings.queued_ms for result in results]
        await asyncio.sleep(0.5)  # back to idle
    return samples


async def measure_publish(redis_url: str) -> float:
    async with ChatClient(redis_url=redis_url, queue=QUEUE) as client:
        log = EventLog(client.redis, replay_ttl_s=60)

        async def publisher(index: int) -> None:
            for _ in range(EVENTS_EACH):
                await log.append(DeltaEvent(job_id=f"pub-{index}", seq=0, text="token"))

        started = time.perf_counter()
        await asyncio.gather(*(publisher(i) for i in range(PUBLISHERS)))
        return PUBLISHERS * EVENTS_EACH / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="store_true", help="EDGEQ_FAST_PICKUP=false")
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--bursts", type=int, default=5)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-pickup-"))
    model = make_tiny_model(scratch / "tiny-model").directory
    redis_server = RedisServer().start()
    env = tiny_model_env(model, redis_server.url, QUEUE) | {
        "EDGEQ_MAX_MODEL_LEN": "512",
        "EDGEQ_MAX_NUM_SEQS": "300",
        "EDGEQ_MAX_QUEUE": "0",
        "EDGEQ_ABANDON_AFTER_S": "0",
    }
    if args.before:
        # 10 ms: the poll the fast pickup was measured against (250, the default now that
        # the fast pickup needs no busy poll, would be arq's poll interval here).
        env |= {"EDGEQ_FAST_PICKUP": "false", "EDGEQ_POLL_DELAY_MS": "10"}
    worker = WorkerProcess(env, scratch / "worker.log").start()
    try:
        worker.wait_ready()
        time.sleep(2.0)  # start-up stragglers
        before = cpu_seconds(worker.process.pid)
        time.sleep(IDLE_SAMPLE_S)
        idle_pct = (cpu_seconds(worker.process.pid) - before) / IDLE_SAMPLE_S * 100

        async def pickup() -> tuple[dict[int, list[float]], list[float]]:
            async with ChatClient(redis_url=redis_server.url, queue=QUEUE, max_queue=0) as client:
                in_flight = await measure_pickup(client, args.probes)
                return in_flight, await measure_bursts(client, args.bursts)

        figures, burst_samples = asyncio.run(pickup())
    finally:
        worker.stop()
    published = asyncio.run(measure_publish(redis_server.url))
    redis_server.stop()

    mode = "EDGEQ_FAST_PICKUP=false (arq's polling)" if args.before else "fast pickup"
    print(f"worker: {mode}; {args.probes} probes each; cores: {os.cpu_count()}")
    print("\n| chats in flight | pickup p50 (ms) | pickup p99 (ms) | max (ms) |")
    print("|---|---|---|---|")
    for in_flight, samples in figures.items():
        print(
            f"| {in_flight} | {statistics.median(samples):.3f} | "
            f"{percentile(samples, 0.99):.3f} | {max(samples):.3f} |"
        )
    print(
        f"| burst of {BURST} at once ({args.bursts}×) | {statistics.median(burst_samples):.3f} | "
        f"{percentile(burst_samples, 0.99):.3f} | {max(burst_samples):.3f} |"
    )
    print(f"\nidle worker process: {idle_pct:.2f} % of one core over {IDLE_SAMPLE_S:g} s")
    print(f"publish path, {PUBLISHERS} concurrent jobs: {published:,.0f} events/s")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
