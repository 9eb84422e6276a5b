"""What structured output costs on this box: grammar compile time, and the seed's burst with
a JSON schema on every request against the same burst without one.

    .venv/bin/python scripts/measure_structured.py [--users 50] [--rounds 3]

Starts a private Redis and one worker on the tiny model (compact JSON, the default), then:

1. Compile time, per schema size: for each of 5 schemas never seen before, one request with
   max_tokens=1 (its worker TTFT holds the grammar compile), the same schema again (cached),
   and one request without a schema; prints median [min-max] of each, and first - none and
   cached - none, the compile's own share.
2. The burst: ``--users`` chats at once (prompts 50-220 words, up to 256 tokens each),
   alternating free text and the ticket schema for ``--rounds`` rounds; prints per mode the
   median [min-max] over rounds of generated tok/s, TTFT p50 and the per-round ratio.

Every figure is from one run on one machine; compare the modes, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgeq.core.protocol import DeltaEvent, DoneEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, WorkerProcess, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model

QUEUE = "edgeq:measure-structured"
WORDS = "the small worker reads a job from the queue and asks the model for an answer".split()
COMPILE_SAMPLES = 5


def ticket_schema(tag: str = "") -> dict[str, Any]:
    """A support ticket: nested object, enum, bounded array and strings (~0.5 KB)."""
    return {
        "type": "object",
        "properties": {
            f"title{tag}": {"type": "string", "maxLength": 24},
            "kind": {"type": "string", "enum": ["bug", "feature", "question"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
            "reporter": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "id": {"type": "integer"},
                },
                "required": ["name", "id"],
            },
            "urgent": {"type": "boolean"},
        },
        "required": [f"title{tag}", "kind", "tags", "reporter"],
    }


def wide_schema(tag: str = "") -> dict[str, Any]:
    """An extraction form: 40 fields of mixed types and enums (~4 KB)."""
    properties: dict[str, Any] = {}
    for n in range(40):
        kind = n % 4
        if kind == 0:
            properties[f"f{n}{tag}"] = {"type": "string", "maxLength": 12}
        elif kind == 1:
            properties[f"f{n}{tag}"] = {"type": "integer"}
        elif kind == 2:
            properties[f"f{n}{tag}"] = {"enum": [f"v{n}a", f"v{n}b", f"v{n}c"]}
        else:
            properties[f"f{n}{tag}"] = {
                "type": "array",
                "items": {"type": "boolean"},
                "maxItems": 3,
            }
    return {"type": "object", "properties": properties, "required": sorted(properties)[:20]}


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 220)))


def cell(values: list[float], digits: int = 1) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


async def worker_ttft_ms(client: ChatClient, **fields: Any) -> float:
    result = await client.chat("Fill the form", max_tokens=1, seed=1, **fields)
    assert result.timings.ttft_ms is not None
    return result.timings.ttft_ms


async def compile_times(client: ChatClient) -> None:
    print("Grammar compile, worker TTFT of a max_tokens=1 request, ms, median [min-max]")
    print(f"over {COMPILE_SAMPLES} schemas never seen before\n")
    print("| schema | size | first use | cached | no schema | first - none | cached - none |")
    print("|---|---|---|---|---|---|---|")
    for name, build in (("ticket", ticket_schema), ("wide", wide_schema)):
        first, cached, none = [], [], []
        for n in range(COMPILE_SAMPLES):
            schema = json_format(build(f"_{name}{n}_{time.monotonic_ns()}"))
            first.append(await worker_ttft_ms(client, response_format=schema))
            cached.append(await worker_ttft_ms(client, response_format=schema))
            none.append(await worker_ttft_ms(client))
        size = len(json.dumps(build()))
        extra = [a - c for a, c in zip(first, none, strict=True)]
        extra_cached = [a - c for a, c in zip(cached, none, strict=True)]
        print(
            f"| {name} | {size} B | {cell(first)} | {cell(cached)} | {cell(none)} "
            f"| {cell(extra)} | {cell(extra_cached)} |"
        )
    print()


async def one_chat(
    client: ChatClient, text: str, seed: int, fields: dict[str, Any]
) -> tuple[float, int]:
    started = time.perf_counter()
    job = await client.submit(text, max_tokens=256, seed=seed, temperature=0.5, **fields)
    first: float | None = None
    done: DoneEvent | None = None
    text: list[str] = []
    async for event in job.stream():
        if isinstance(event, DeltaEvent):
            first = first or time.perf_counter()
            text.append(event.text)
        elif isinstance(event, DoneEvent):
            done = event
    assert done is not None and first is not None
    if fields and done.finish_reason == "stop":
        json.loads("".join(text))  # a finished schema answer always parses
    return (first - started) * 1000, done.usage.completion_tokens


async def burst(
    client: ChatClient, users: int, rng: random.Random, fields: dict[str, Any]
) -> tuple[float, float, float]:
    texts = [prompt(rng) for _ in range(users)]
    started = time.perf_counter()
    chats = await asyncio.gather(
        *(one_chat(client, t, 100 + n, fields) for n, t in enumerate(texts))
    )
    wall = time.perf_counter() - started
    ttfts = [ttft for ttft, _ in chats]
    tokens = sum(count for _, count in chats)
    return tokens / wall, statistics.median(ttfts), tokens / users


async def bursts(client: ChatClient, users: int, rounds: int) -> None:
    rng = random.Random(0)
    modes = {"free text": {}, "ticket schema": {"response_format": json_format(ticket_schema())}}
    figures: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, fields in modes.items():
            figures[mode].append(await burst(client, users, rng, fields))
            await asyncio.sleep(1.0)
    print(
        f"Seed burst: {users} chats at once, ≤256 tokens, median [min-max] over {rounds} rounds\n"
    )
    print("| mode | tok/s | TTFT p50 (ms) | tokens per answer |")
    print("|---|---|---|---|")
    for mode, rows in figures.items():
        tok_s, ttft, per_answer = (list(column) for column in zip(*rows, strict=True))
        print(f"| {mode} | {cell(tok_s, 0)} | {cell(ttft)} | {cell(per_answer, 0)} |")
    plain, schema = figures["free text"], figures["ticket schema"]
    ratio_tok = [s[0] / p[0] for p, s in zip(plain, schema, strict=True)]
    ratio_ttft = [s[1] / p[1] for p, s in zip(plain, schema, strict=True)]
    print(
        f"\nschema / free text, per round: tok/s {cell(ratio_tok, 2)}, "
        f"TTFT p50 {cell(ratio_ttft, 2)}"
    )


async def measure(url: str, users: int, rounds: int) -> None:
    async with ChatClient(redis_url=url, queue=QUEUE, max_queue=0) as client:
        await client.chat("warm up", max_tokens=4)
        await client.chat("warm up", max_tokens=4, response_format=json_format({"type": "object"}))
        await compile_times(client)
        await bursts(client, users, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-structured-"))
    model = make_tiny_model(scratch / "tiny-model").directory
    redis_server = RedisServer().start()
    env = tiny_model_env(model, redis_server.url, QUEUE) | {"EDGEQ_MAX_MODEL_LEN": "2048"}
    worker = WorkerProcess(env, scratch / "worker.log").start()
    try:
        worker.wait_ready()
        asyncio.run(measure(redis_server.url, args.users, args.rounds))
    finally:
        worker.stop()
        redis_server.stop()
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
