"""What rate limits and token budgets cost an enqueue (issue #42): a limited tenant's submits
against an unlimited one's, through the same script.

    .venv/bin/python -m edgeq.bench.limits_overhead [--rounds 3] [--jobs 2000] [--burst 50]

On a private ``redis-server``, with ``JobQueue.enqueue`` (what ``ChatClient.submit`` and the
batch runner run, without the subscription), alternating over the rounds:

- ``off``: a tenant with no limits (the enqueue passes the limits keys and the script finds
  none: nothing is read or counted beyond the tenancy fields it reads anyway);
- ``on``: a tenant with all four limits, set far above what the round submits (every submit is
  admitted, counted and reserved);
- ``key``: the same tenant's submits sent with an API key's name (``key_name``) that has all
  four limits too (each submit is admitted, counted and reserved in both scopes).

Each round, on a fresh queue: ``--jobs`` enqueues one after the other (the latency of one
submit), then ``--jobs`` more in bursts of ``--burst`` concurrent ones (one script call per
burst, core/batching.py). Printed per mode: the median of the rounds' medians of a lone
enqueue (µs), with the range, and the bursts' enqueues per second, likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from redis.asyncio import Redis

from edgeq.core.scheduling import Tenancy, publish_tenancy
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.testing.processes import RedisServer

REQUEST = {"messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 16}
BIG = 10**12  # every limit far above what a round submits
LIMITED = {
    "rpm": {"bench": BIG}, "tpm": {"bench": BIG},
    "tokens_per_day": {"bench": BIG}, "tokens_per_month": {"bench": BIG},
}  # fmt: skip
KEY_LIMITED = {f"key_{name}": {"web": BIG} for name in LIMITED}
#: Each mode's rules and the key name its submits carry (None: none).
MODES: dict[str, tuple[Tenancy, str | None]] = {
    "off": (Tenancy(), None),
    "on": (Tenancy(**LIMITED), None),  # type: ignore[arg-type]
    "key": (Tenancy(**LIMITED, **KEY_LIMITED), "web"),  # type: ignore[arg-type]
}


async def _enqueue(queue: JobQueue, key_name: str | None) -> None:
    outcome = await queue.enqueue(
        uuid.uuid4().hex, REQUEST, deadline_s=600, max_depth=0, tenant="bench", priority=None,
        key_name=key_name,
    )  # fmt: skip
    assert outcome.outcome is Enqueued.ACCEPTED, outcome


async def one_round(
    redis: Redis, mode: tuple[Tenancy, str | None], jobs: int, burst: int
) -> tuple[float, float]:
    """(median µs of a lone enqueue, enqueues per second in bursts) on a fresh queue."""
    tenancy, key_name = mode
    name = f"edgeq:bench-limits-{uuid.uuid4().hex[:8]}"
    await publish_tenancy(redis, name, tenancy)
    queue = JobQueue(redis, name)
    await _enqueue(queue, key_name)  # the script loaded, the connection made
    lone = []
    for _ in range(jobs):
        start = time.perf_counter()
        await _enqueue(queue, key_name)
        lone.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(jobs // burst):
        await asyncio.gather(*(_enqueue(queue, key_name) for _ in range(burst)))
    rate = (jobs // burst) * burst / (time.perf_counter() - start)
    await redis.flushdb()
    return statistics.median(lone) * 1e6, rate


def _summary(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.1f} {unit} [{min(values):.1f}-{max(values):.1f}]"


async def run(rounds: int, jobs: int, burst: int) -> dict[str, list[tuple[float, float]]]:
    server = RedisServer().start()
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    try:
        redis = Redis.from_url(server.url)
        try:
            for _ in range(rounds):
                for mode, rules in MODES.items():  # alternating: drift hits all alike
                    results[mode].append(await one_round(redis, rules, jobs, burst))
        finally:
            await redis.aclose()
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edgeq.bench.limits_overhead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--burst", type=int, default=50)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.rounds, args.jobs, args.burst))
    print(f"{args.rounds} rounds, {args.jobs} jobs each; median [range] over the rounds")
    for mode, rows in results.items():
        lone = _summary([row[0] for row in rows], "µs")
        rate = _summary([row[1] for row in rows], "/s")
        print(f"limits {mode:<3}  lone enqueue {lone}  bursts of {args.burst}: {rate}")


if __name__ == "__main__":
    main()
