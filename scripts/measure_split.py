"""How two workers on one queue share a burst bigger than one of them: which worker started how
many chats, and how long the chats waited in the queue.

    .venv/bin/python scripts/measure_split.py [--runs 3] [--chats 80] [--max-tokens 300]

Each run starts Redis and two workers (tiny model, max_jobs 64 each), submits the burst at
once and waits for every answer; chats that end with an error are counted by code. The
workers inherit this script's environment, PYTHONPATH included, so an older checkout can be
measured; run from outside any checkout (see measure_pickup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from edgeq.core.errors import JobFailed
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model

QUEUE = "edgeq:split"
WORKERS = 2
SEEDS = (8, 10, 12)  # on the tiny model these run to max_tokens (tests/helpers.py)


async def submit_burst(
    redis_url: str, chats: int, max_tokens: int
) -> tuple[list[float], Counter[str], float]:
    """Queue-wait of each chat that ended with done, the error codes of the others, seconds."""
    async with ChatClient(redis_url=redis_url, queue=QUEUE, max_queue=0) as client:
        started = time.perf_counter()
        jobs = await asyncio.gather(
            *(
                client.submit(f"burst {n}", max_tokens=max_tokens, seed=SEEDS[n % len(SEEDS)])
                for n in range(chats)
            )
        )
        outcomes = await asyncio.gather(*(job.result() for job in jobs), return_exceptions=True)
        took = time.perf_counter() - started
    failed: Counter[str] = Counter()
    queued = []
    for outcome in outcomes:
        if isinstance(outcome, JobFailed):
            failed[outcome.code] += 1
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            queued.append(outcome.timings.queued_ms)
    return queued, failed, took


def run_once(model: Path, scratch: Path, args: argparse.Namespace) -> str:
    redis_server = RedisServer().start()
    env = tiny_model_env(model, redis_server.url, QUEUE) | {"EDGEQ_MAX_MODEL_LEN": "512"}
    workers = [WorkerProcess(env, scratch / f"worker-{n}.log") for n in range(WORKERS)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.wait_ready()
        queued, failed, took = asyncio.run(
            submit_burst(redis_server.url, args.chats, args.max_tokens)
        )
        split = [
            sum(event.get("event") == "job_started" for event in worker.log_events())
            for worker in workers
        ]
    finally:
        for worker in workers:
            worker.stop()
        redis_server.stop()
    waits = f"{statistics.median(queued):.0f} | {max(queued):.0f}" if queued else "- | -"
    failures = ", ".join(f"{code} {count}" for code, count in failed.items()) or "none"
    return f"| {' / '.join(map(str, split))} | {took:.1f} | {waits} | {failures} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chats", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-split-"))
    model = make_tiny_model(scratch / "tiny-model").directory
    rows = [run_once(model, scratch / f"run-{n}", args) for n in range(args.runs)]
    print(
        f"{args.chats} chats × {args.max_tokens} tokens, {WORKERS} workers; cores: {os.cpu_count()}"
    )
    print(
        "\n| chats started per worker | burst took (s) | queued p50 (ms) | queued max (ms) "
        "| not done |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
