"""What the OpenAI-compatible gateway adds: TTFT and end-to-end time of the same chats through
`ChatClient` and through the gateway (the official OpenAI SDK, streaming), in one run.

    .venv/bin/python scripts/measure_gateway.py [--chats 100] [--concurrent 32] [--samples]

Starts its own Redis, one worker on the tiny model and one gateway. Sequential chats alternate
between the two paths, so machine noise falls on both alike; then a burst of `--concurrent`
chats goes through each path. TTFT is measured at the caller: submit → first text.
`--samples` also prints a metrics scrape and `edgeq status` for the README.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai

from producer.client import ChatClient
from producer.protocol import DeltaEvent
from worker.localrun import GatewayProcess, RedisServer, WorkerProcess
from worker.tiny_model import make_tiny_model

MAX_TOKENS = 32
SEED = 8  # the tiny model runs MAX_TOKENS tokens without an end-of-turn on this seed

Timed = tuple[float, float]  # TTFT ms, end-to-end ms


async def through_client(client: ChatClient, prompt: str) -> Timed:
    started = time.perf_counter()
    first = None
    job = await client.submit(prompt, max_tokens=MAX_TOKENS, seed=SEED)
    async for event in job.stream():
        if first is None and isinstance(event, DeltaEvent) and event.text:
            first = time.perf_counter()
    ended = time.perf_counter()
    return ((first or ended) - started) * 1000, (ended - started) * 1000


async def through_gateway(sdk: openai.AsyncOpenAI, model: str, prompt: str) -> Timed:
    started = time.perf_counter()
    first = None
    stream = await sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        seed=SEED,
        stream=True,
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    ended = time.perf_counter()
    return ((first or ended) - started) * 1000, (ended - started) * 1000


def summary(name: str, timed: list[Timed]) -> str:
    ttft = sorted(t for t, _ in timed)
    e2e = sorted(e for _, e in timed)

    def p(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    return (
        f"| {name} | {len(timed)} | {statistics.median(ttft):.2f} | {p(ttft, 0.9):.2f} | "
        f"{p(ttft, 0.99):.2f} | {statistics.median(e2e):.2f} | {p(e2e, 0.99):.2f} |"
    )


async def burst(make: Callable[[int], Awaitable[Timed]], count: int) -> list[Timed]:
    return list(await asyncio.gather(*(make(n) for n in range(count))))


async def measure(args: argparse.Namespace, worker: WorkerProcess, base_url: str) -> None:
    model = worker.env["EDGEQ_MODEL"]
    url, queue = worker.env["EDGEQ_REDIS_URL"], worker.env["EDGEQ_QUEUE"]
    limits = httpx.Limits(max_keepalive_connections=100, max_connections=200)
    async with (
        ChatClient(redis_url=url, queue=queue) as client,
        openai.AsyncOpenAI(
            base_url=base_url, api_key="EMPTY", http_client=httpx.AsyncClient(limits=limits)
        ) as sdk,
    ):
        for n in range(5):  # warm both paths (connections, the gateway's first request)
            await through_client(client, f"warm {n}")
            await through_gateway(sdk, model, f"warm {n}")
        direct: list[Timed] = []
        gateway: list[Timed] = []
        for n in range(args.chats):
            direct.append(await through_client(client, f"question {n}"))
            gateway.append(await through_gateway(sdk, model, f"question {n}"))
        direct_burst = await burst(lambda n: through_client(client, f"burst {n}"), args.concurrent)
        gateway_burst = await burst(
            lambda n: through_gateway(sdk, model, f"burst {n}"), args.concurrent
        )
    print("| path | chats | TTFT p50 ms | p90 | p99 | e2e p50 ms | e2e p99 |")
    print("|---|---|---|---|---|---|---|")
    print(summary("ChatClient, one at a time", direct))
    print(summary("gateway (OpenAI SDK, stream), one at a time", gateway))
    print(summary(f"ChatClient, {args.concurrent} at once", direct_burst))
    print(summary(f"gateway, {args.concurrent} at once", gateway_burst))
    added = statistics.median(g for g, _ in gateway) - statistics.median(d for d, _ in direct)
    print(f"\ngateway's added TTFT, one at a time (p50 difference): {added:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--samples", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-gateway-"))
    model = make_tiny_model(scratch / "model").directory
    redis_server = RedisServer().start()
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": "edgeq:measure",
        "EDGEQ_MODEL": str(model),
        "EDGEQ_MAX_MODEL_LEN": "512",
        "EDGEQ_CPU_KV_CACHE_GIB": "1",
        "HF_HUB_OFFLINE": "1",
    }
    worker = WorkerProcess(env, scratch / "worker.log").start()
    gateway = None
    try:
        worker.wait_ready()
        gateway = GatewayProcess(env, scratch / "gateway.log").start()
        asyncio.run(measure(args, worker, gateway.base_url))
        if args.samples:
            page = httpx.get(f"http://127.0.0.1:{worker.metrics_port}/metrics").text
            wanted = ("edgeq:", "vllm:kv_cache_usage_perc")
            print("\n".join(line for line in page.splitlines() if line.startswith(wanted)))
            status = [sys.executable, "-m", "producer.cli", "status"]
            print(subprocess.run(status, env=env, capture_output=True, text=True).stdout)
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        redis_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
