"""Figures for the core pipeline, each next to the same workload run directly on the engine.

    .venv/bin/python scripts/measure_core.py [--chats 50] [--tokens 64] [--model DIR]

1. start a private Redis and one `edgeq worker` on the tiny model (or --model); time start-up;
2. through the whole pipeline (ChatClient → Redis → arq → engine → pub/sub): warm TTFT of
   single chats, then N concurrent chats;
3. stop the worker, build the same engine in this process, run the same workload directly.

Prints a Markdown table. Not a load test: `edgeq bench` (planned) is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from edgeq.core.protocol import ChatRequest, DeltaEvent, DoneEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model

SINGLE_CHATS = 20
SINGLE_TOKENS = 16
# The tiny model samples near-uniformly; these seeds never draw <|im_end|> early (see tests).
FULL_LENGTH_SEED = 8


def engine_env(model: str, redis_url: str) -> dict[str, str]:
    return tiny_model_env(model, redis_url, "edgeq:measure")


def request(index: int, tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "user", "content": f"Question {index}: tell me something."}],
        max_tokens=tokens,
        seed=FULL_LENGTH_SEED,
    )


async def pipeline_chat(client: ChatClient, req: ChatRequest) -> tuple[float, float, int]:
    """(ttft_s, total_s, completion_tokens) as the caller sees them."""
    started = time.perf_counter()
    job = await client.submit(req)
    first: float | None = None
    tokens = 0
    async for event in job.stream():
        if isinstance(event, DeltaEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, DoneEvent):
            tokens = event.usage.completion_tokens
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, tokens


async def direct_chat(engine, req: ChatRequest, request_id: str) -> tuple[float, float, int]:
    started = time.perf_counter()
    prompt = await engine.render(req.messages, enable_thinking=False)
    params = engine.sampling_params(req, len(prompt))
    first: float | None = None
    tokens = 0
    async for output in engine.generate(prompt, params, request_id):
        if output.outputs[0].token_ids and first is None:
            first = time.perf_counter()
        tokens += len(output.outputs[0].token_ids)
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, tokens


async def workload(
    chat: Callable[[ChatRequest, str], Awaitable[tuple[float, float, int]]],
    chats: int,
    tokens: int,
) -> dict[str, float]:
    singles = [await chat(request(i, SINGLE_TOKENS), f"s{i}") for i in range(SINGLE_CHATS)]
    started = time.perf_counter()
    burst = await asyncio.gather(*(chat(request(i, tokens), f"b{i}") for i in range(chats)))
    wall = time.perf_counter() - started
    return {
        "ttft_p50_ms": statistics.median(s[0] for s in singles) * 1000,
        "burst_wall_s": wall,
        "burst_ttft_p50_ms": statistics.median(b[0] for b in burst) * 1000,
        "burst_tokens": sum(b[2] for b in burst),
        "burst_tok_per_s": sum(b[2] for b in burst) / wall,
    }


async def run_direct(model: str, chats: int, tokens: int) -> tuple[float, dict[str, float]]:
    began = time.perf_counter()  # like the worker's figure: vLLM's import included
    os.environ.update(engine_env(model, "redis://unused"))
    from edgeq.core.settings import load_settings
    from edgeq.worker.engine import ChatEngine
    from edgeq.worker.settings import WorkerSettings

    engine = await ChatEngine.start(load_settings(WorkerSettings))
    await engine.warm_up()
    startup = time.perf_counter() - began
    try:
        figures = await workload(lambda r, rid: direct_chat(engine, r, rid), chats, tokens)
    finally:
        engine.shutdown()
    return startup, figures


async def run_pipeline(worker: WorkerProcess, chats: int, tokens: int) -> dict[str, float]:
    async with ChatClient(
        redis_url=worker.env["EDGEQ_REDIS_URL"], queue=worker.env["EDGEQ_QUEUE"]
    ) as client:
        return await workload(lambda r, _: pipeline_chat(client, r), chats, tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", help="model directory (default: a fresh tiny model)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-measure-"))
    model = args.model or str(make_tiny_model(scratch / "tiny-model").directory)

    redis_server = RedisServer().start()
    worker = WorkerProcess(engine_env(model, redis_server.url), scratch / "worker.log")
    spawned = time.perf_counter()
    worker.start()
    try:
        ready = worker.wait_ready()
        worker_startup = time.perf_counter() - spawned
        pipeline = asyncio.run(run_pipeline(worker, args.chats, args.tokens))
    finally:
        worker.stop()
        redis_server.stop()
    direct_startup, direct = asyncio.run(run_direct(model, args.chats, args.tokens))

    print(
        f"model: {model}; {args.chats} concurrent chats × {args.tokens} tokens; "
        f"{SINGLE_CHATS} single chats × {SINGLE_TOKENS} tokens; cores: {os.cpu_count()}"
    )
    print("\n| figure | through edgeq | direct on the engine | ratio |\n|---|---|---|---|")
    rows = [
        ("start-up to ready (s)", worker_startup, direct_startup),
        ("warm TTFT of one chat, p50 (ms)", pipeline["ttft_p50_ms"], direct["ttft_p50_ms"]),
        (f"{args.chats} concurrent chats, wall (s)", pipeline["burst_wall_s"],
         direct["burst_wall_s"]),
        (f"{args.chats} concurrent chats, TTFT p50 (ms)", pipeline["burst_ttft_p50_ms"],
         direct["burst_ttft_p50_ms"]),
        (f"{args.chats} concurrent chats, output tok/s", pipeline["burst_tok_per_s"],
         direct["burst_tok_per_s"]),
    ]  # fmt: skip
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")
    print(
        f"\nworker's own start-up log: engine build {ready['engine_build_s']} s, warm-up "
        f"{ready['warmup_s']} s, {ready['since_process_start_s']} s since process start; "
        f"tokens generated: {pipeline['burst_tokens']:.0f} vs {direct['burst_tokens']:.0f}"
    )
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
