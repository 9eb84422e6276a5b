"""What the OpenAI-compatible gateway adds: TTFT and end-to-end time of the same chats through
`ChatClient` and through the gateway (the official OpenAI SDK, streaming), in one run.

    .venv/bin/python scripts/measure_gateway.py [--chats 100] [--concurrent 32] [--samples]

Starts its own Redis, one worker on the tiny model and two gateways. Sequential chats go
through the two paths in alternating blocks, so machine noise falls on both alike; then a
burst of `--concurrent` chats goes through each path. TTFT is measured at the caller: submit →
first text. Then, with the engine idle, the delivery cost alone: this script appends events to
a job's stream itself (as a worker would) and times append → event in hand, through ChatClient
and through the second gateway, whose queue no worker serves.
`--samples` also prints a metrics scrape and `edgeq status` for the README.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai

from edgeq.core.errors import StreamClosed
from edgeq.core.protocol import DeltaEvent, DoneEvent, Timings, Usage
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model

MAX_TOKENS = 32
SEED = 8  # the tiny model runs MAX_TOKENS tokens without an end-of-turn on this seed

DELIVERY_QUEUE = "edgeq:measure-delivery"
DELIVERY_EVENTS = 20  # per stream

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


async def queued_jobs(client: ChatClient, count: int = 1) -> list[str]:
    while True:  # polling Redis: the gateway's enqueue sends no event this script could await
        ids = await client.redis.zrange(DELIVERY_QUEUE, 0, -1)
        if len(ids) >= count:
            return [raw.decode() for raw in ids]
        await asyncio.sleep(0.001)


async def finish(client: ChatClient, job_id: str) -> None:
    usage = Usage(prompt_tokens=1, completion_tokens=DELIVERY_EVENTS)
    timings = Timings(queued_ms=0, ttft_ms=0, total_ms=0)
    done = DoneEvent(job_id=job_id, seq=0, finish_reason="stop", usage=usage, timings=timings)
    with contextlib.suppress(StreamClosed):  # the gateway cancelled it: its client left
        await client.events.append(done)
    await client.redis.zrem(DELIVERY_QUEUE, job_id)


async def delivery_ms(client: ChatClient, sdk: openai.AsyncOpenAI, model: str, streams: int):
    """Append → event in hand, in ms: through ChatClient, and through the gateway."""
    direct: list[float] = []
    gateway: list[float] = []
    for _ in range(streams):
        job = await client.submit("delivery")
        events = job.stream()
        for n in range(DELIVERY_EVENTS):
            started = time.perf_counter()
            await client.events.append(DeltaEvent(job_id=job.job_id, seq=0, text=f"{n} "))
            await anext(events)
            direct.append((time.perf_counter() - started) * 1000)
        await finish(client, job.job_id)
        await job.aclose()

        request = asyncio.create_task(
            sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "delivery"}], stream=True
            )
        )
        (job_id,) = await queued_jobs(client)
        await client.events.append(DeltaEvent(job_id=job_id, seq=0, text="first"))
        stream = await request
        chunks = aiter(stream)
        while (await anext(chunks)).choices[0].delta.content != "first":
            pass
        for n in range(DELIVERY_EVENTS):
            started = time.perf_counter()
            await client.events.append(DeltaEvent(job_id=job_id, seq=0, text=f"{n} "))
            await anext(chunks)
            gateway.append((time.perf_counter() - started) * 1000)
        await finish(client, job_id)
        await stream.close()
    return direct, gateway


async def delivery_burst_ms(
    client: ChatClient, sdk: openai.AsyncOpenAI, model: str, count: int
) -> tuple[list[float], list[float]]:
    """``count`` streams open at once; one event appended to each, in a row: append of the
    first → each stream's first event in hand, in ms, through ChatClient and the gateway."""

    async def first_event_via_client(job: ChatJob) -> float:
        await anext(job.stream())
        await job.aclose()
        return time.perf_counter()

    async def first_event_via_gateway(n: int) -> float:
        stream = await sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"burst {n}"}], stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        arrived = time.perf_counter()
        await stream.close()
        return arrived

    results = []
    for via_gateway in (False, True):
        if via_gateway:
            waiting = [asyncio.create_task(first_event_via_gateway(n)) for n in range(count)]
        else:
            jobs = [await client.submit(f"burst {n}") for n in range(count)]
            waiting = [asyncio.create_task(first_event_via_client(job)) for job in jobs]
        ids = await queued_jobs(client, count)
        await asyncio.sleep(0.2)  # every stream is listening
        started = time.perf_counter()
        for job_id in ids:
            await client.events.append(DeltaEvent(job_id=job_id, seq=0, text="hi"))
        arrivals = await asyncio.gather(*waiting)
        results.append([(arrived - started) * 1000 for arrived in arrivals])
        for job_id in ids:
            await finish(client, job_id)
    return results[0], results[1]


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, timed: list[Timed]) -> str:
    ttft = [t for t, _ in timed]
    e2e = [e for _, e in timed]
    return (
        f"| {name} | {len(timed)} | {p(ttft, 0.5):.2f} | {p(ttft, 0.9):.2f} | "
        f"{p(ttft, 0.99):.2f} | {p(e2e, 0.5):.2f} | {p(e2e, 0.99):.2f} |"
    )


async def burst(make: Callable[[int], Awaitable[Timed]], count: int) -> list[Timed]:
    return list(await asyncio.gather(*(make(n) for n in range(count))))


async def measure(
    args: argparse.Namespace, worker: WorkerProcess, base_url: str, delivery_url: str
) -> None:
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
        # Blocks of ten, alternating: machine noise falls on both paths alike, and a path's
        # after-effects (a busy CPU) do not land on the other's first chats.
        for block in range(0, args.chats, 10):
            for n in range(block, min(block + 10, args.chats)):
                direct.append(await through_client(client, f"question {n}"))
            for n in range(block, min(block + 10, args.chats)):
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
    added = p([g for g, _ in gateway], 0.5) - p([d for d, _ in direct], 0.5)
    print(f"\ngateway's added TTFT, one at a time (p50 difference): {added:.2f} ms")

    async with (
        ChatClient(redis_url=url, queue=DELIVERY_QUEUE) as client,
        openai.AsyncOpenAI(base_url=delivery_url, api_key="EMPTY") as sdk,
    ):
        direct_ms, gateway_ms = await delivery_ms(client, sdk, model, streams=10)
        burst_direct, burst_gateway = await delivery_burst_ms(client, sdk, model, args.concurrent)
    print("\n| delivery, engine idle | events | append → event p50 ms | p90 | p99 |")
    print("|---|---|---|---|---|")
    for name, ms in (
        ("ChatClient, one stream", direct_ms),
        ("gateway (OpenAI SDK), one stream", gateway_ms),
        (f"ChatClient, {args.concurrent} streams at once", burst_direct),
        (f"gateway (OpenAI SDK), {args.concurrent} streams at once", burst_gateway),
    ):
        print(f"| {name} | {len(ms)} | {p(ms, 0.5):.2f} | {p(ms, 0.9):.2f} | {p(ms, 0.99):.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--samples", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-gateway-"))
    model = make_tiny_model(scratch / "model").directory
    redis_server = RedisServer().start()
    env = tiny_model_env(model, redis_server.url, "edgeq:measure") | {"EDGEQ_MAX_MODEL_LEN": "512"}
    worker = WorkerProcess(env, scratch / "worker.log").start()
    gateways: list[GatewayProcess] = []
    try:
        worker.wait_ready()
        gateways.append(GatewayProcess(env, scratch / "gateway.log").start())
        delivery_env = {**env, "EDGEQ_QUEUE": DELIVERY_QUEUE}
        gateways.append(GatewayProcess(delivery_env, scratch / "delivery.log").start())
        asyncio.run(measure(args, worker, gateways[0].base_url, gateways[1].base_url))
        if args.samples:
            page = httpx.get(f"http://127.0.0.1:{worker.metrics_port}/metrics").text
            wanted = ("edgeq:", "vllm:kv_cache_usage_perc")
            print("\n".join(line for line in page.splitlines() if line.startswith(wanted)))
            status = [sys.executable, "-m", "edgeq", "status"]
            print(subprocess.run(status, env=env, capture_output=True, text=True).stdout)
    finally:
        for gateway in gateways:
            gateway.stop()
        worker.stop()
        redis_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
