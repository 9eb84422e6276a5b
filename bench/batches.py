"""A batch through edgeq against vLLM's offline batch runner (issue #30), and what a running
batch does to interactive chats.

    .venv/bin/python -m edgeq.bench.batches [--rounds 3] [--lines 1000] [--chats 10]

The input: ``--lines`` seed-like chats (prompts of 64-256 tokens, ``max_tokens`` 128, each
with its own sampling seed) as one Batch API file. Each round runs, in alternating order:

- ``edgeq``: the file through a running ``edgeq gateway`` (upload, create, poll, download the
  output) to a warm ``edgeq worker`` on a private Redis. Wall time from the upload's start to
  the output file downloaded.
- ``run-batch``: vLLM's own offline runner on the same file: the function that ``python -m
  vllm.entrypoints.openai.run_batch`` calls once its engine is up
  (``vllm.entrypoints.launchers.run_batch.run_batch``), in a process of its own, on an engine
  built from the same settings as the worker's (``edgeq.worker.engine``: same engine arguments
  and vLLM plugin) and warmed up the same way. Two walls: the run alone (engine warm, what a
  batch costs a box whose engine is up) and the whole process (engine start included, what
  running the offline tool costs each time).

Interactive chats: before each round's ``edgeq`` batch, ``--chats`` chats sent 0.5 s apart to
the idle worker (``priority="interactive"``, through the queue); then the same chats once a
quarter of the batch's lines are done. TTFT is submit to first token; per round the p50 of
each, and their ratio (target: mid-batch p50 <= 1.5 x idle p50).

Also per edgeq batch: the CPU seconds each of edgeq's processes used (worker, its engine,
gateway, Redis), and what the last lines' jobs hold in Redis right after it (events, and
arq's result). Printed: each round, then each figure's median [min-max] over the rounds, and
the ratios as the median of the per-round ratios. On a CPU-only machine the engine shares the
cores with Redis, the worker, the gateway and this client: the figures say what the queue
costs here, not on a GPU box. docs/performance.md states its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis.asyncio import Redis

from edgeq.bench.rounds import spread_text
from edgeq.bench.workload import WorkloadSpec, build_workload, load_tokenizer
from edgeq.core.keys import events_key, result_key
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess, stop_process
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.engine_processes import engine_pids

QUEUE = "edgeq:bench-batches"
# The same sizes as tests' workers on a small CPU box: a small KV cache and context.
WORKER_ENV = {
    "EDGEQ_CPU_KV_CACHE_GIB": "1",
    "EDGEQ_MAX_MODEL_LEN": "2048",
    "EDGEQ_LOG_LEVEL": "warning",
    "HF_HUB_OFFLINE": "1",
}
#: Seconds between two interactive chats, and how often the batch's progress is read.
CHAT_GAP_S = 0.5
POLL_S = 0.2
#: The interactive chats start once this share of the batch's lines is done.
MID_BATCH_SHARE = 0.25
#: How many lines' jobs (the last ones) are looked at for what a job holds in Redis.
LINES_SAMPLED = 50


def batch_file(model: str, lines: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """Seed-like chats as Batch API input lines (the bench's workload: edgeq.bench.workload)."""
    spec = WorkloadSpec(
        num_requests=lines,
        input_len_min=64,
        input_len_max=256,
        max_tokens=max_tokens,
        temperature=0.5,
        top_p=0.9,
        seed=seed,
    )
    workload = build_workload(spec, load_tokenizer(model), model)
    return [
        {
            "custom_id": f"line-{request.index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [message.model_dump() for message in request.messages],
                "max_tokens": spec.max_tokens,
                "temperature": spec.temperature,
                "top_p": spec.top_p,
                "seed": request.seed,
            },
        }
        for request in workload.requests
    ]


def output_figures(text: str) -> dict[str, float]:
    """Completed lines and generated tokens of an output file (errors are counted apart)."""
    completed = tokens = 0
    for entry in map(json.loads, text.splitlines()):
        response = entry.get("response") or {}
        if response.get("status_code") == 200:
            completed += 1
            tokens += response["body"]["usage"]["completion_tokens"]
    return {"completed": completed, "tokens": tokens}


async def interactive_ttfts(client: ChatClient, chats: Sequence[dict[str, Any]]) -> list[float]:
    """Send the chats CHAT_GAP_S apart; each one's submit-to-first-token time, ms."""

    async def one(delay_s: float, fields: dict[str, Any]) -> float:
        await asyncio.sleep(delay_s)
        began = time.perf_counter()
        job = await client.submit(**fields, priority="interactive")
        first: float | None = None
        async for event in job.stream():
            if event.type == "delta" and event.text and first is None:
                first = time.perf_counter()
            elif event.type == "error":
                raise RuntimeError(f"an interactive chat failed: {event.code}: {event.message}")
            elif event.type == "done":
                if first is None:
                    raise RuntimeError("an interactive chat ended without text")
                return (first - began) * 1000
        raise RuntimeError("an interactive chat's stream ended without a terminal event")

    return list(await asyncio.gather(*(one(n * CHAT_GAP_S, chat) for n, chat in enumerate(chats))))


def cpu_seconds(processes: Mapping[str, Sequence[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds each group of processes has used so far."""
    return {
        name: sum(sum(process.cpu_times()[:2]) for process in group)
        for name, group in processes.items()
    }


async def line_job_costs(redis: Redis, output: str) -> dict[str, float]:
    """What the last LINES_SAMPLED completed lines' jobs hold in Redis right after the batch:
    medians of their events (count, bytes) and of arq's result (bytes; kept 60 s, so the
    latest lines')."""
    job_ids = [
        entry["response"]["request_id"]
        for entry in map(json.loads, output.splitlines())
        if (entry.get("response") or {}).get("status_code") == 200
    ][-LINES_SAMPLED:]
    events, event_bytes, result_bytes = [], [], []
    for job_id in job_ids:
        events.append(await redis.xlen(events_key(job_id)))
        event_bytes.append(await redis.memory_usage(events_key(job_id)) or 0)
        if (size := await redis.memory_usage(result_key(job_id))) is not None:
            result_bytes.append(size)
    return {
        "events": statistics.median(events),
        "event_bytes": statistics.median(event_bytes),
        "result_bytes": statistics.median(result_bytes) if result_bytes else math.nan,
    }


async def edgeq_batch(
    base: str,
    content: bytes,
    client: ChatClient,
    chats: Sequence[dict[str, Any]],
    processes: Mapping[str, Sequence[psutil.Process]],
) -> dict[str, Any]:
    """The file through the gateway, the interactive chats sent a quarter of the way in; the
    CPU seconds of each of edgeq's processes meanwhile, and what the lines' jobs hold in Redis."""
    cpu_before = cpu_seconds(processes)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        began = time.perf_counter()
        upload = await http.post(
            "/files", files={"file": ("input.jsonl", content)}, data={"purpose": "batch"}
        )
        upload.raise_for_status()
        created = await http.post(
            "/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id = created.json()["id"]
        chatting: asyncio.Task[list[float]] | None = None
        chats_done_at: int | None = None
        while True:
            batch = (await http.get(f"/batches/{batch_id}")).raise_for_status().json()
            counts = batch["request_counts"]
            if chatting is None and counts["completed"] >= counts["total"] * MID_BATCH_SHARE:
                chatting = asyncio.create_task(interactive_ttfts(client, chats))
            if chatting is not None and chatting.done() and chats_done_at is None:
                chats_done_at = counts["completed"]
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(POLL_S)
        if batch["status"] != "completed":
            raise RuntimeError(f"the batch ended {batch['status']}: {batch.get('errors')}")
        output = await http.get(f"/files/{batch['output_file_id']}/content")
        wall_s = time.perf_counter() - began
        # Each round's files count against the tenant's caps (EDGEQ_GATEWAY_FILES_PER_TENANT):
        # deleted, so any number of rounds runs.
        for file_id in (upload.json()["id"], batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                (await http.delete(f"/files/{file_id}")).raise_for_status()
    cpu_after = cpu_seconds(processes)
    assert chatting is not None
    ttfts = await chatting
    return {
        "wall_s": wall_s,
        **output_figures(output.text),
        "cpu_s": {name: cpu_after[name] - cpu_before[name] for name in processes},
        "line_job": await line_job_costs(client.redis, output.text),
        "failed": counts["failed"],
        "mid_ttfts": ttfts,
        # Lines done when the last chat had its answer: below the total, the chats ran mid-batch.
        "lines_done_after_chats": chats_done_at if chats_done_at is not None else counts["total"],
    }


def run_batch(path: Path, out: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    """vLLM's runner on the file in a process of its own (see ``_run_batch_process``)."""
    began = time.perf_counter()
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "edgeq.bench.batches", "--vllm-run-batch", str(path), str(out)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=sink,
            start_new_session=True,
        )
        try:
            stdout, _ = process.communicate(timeout=3600)
        finally:
            if process.poll() is None:
                stop_process(process, signal.SIGKILL)
    if process.returncode != 0:
        raise RuntimeError(f"vLLM's run_batch failed (exit {process.returncode}); see {log}")
    timings = json.loads(stdout.decode().strip().splitlines()[-1])
    return {
        **timings,
        "process_s": time.perf_counter() - began,
        **output_figures(out.read_text()),
    }


async def _run_batch_process(path: Path, out: Path) -> None:
    """In its own process: build the worker's engine, warm it, time vLLM's run_batch on the
    file, print the times as one JSON line."""
    from vllm.entrypoints.launchers.run_batch import make_arg_parser
    from vllm.entrypoints.launchers.run_batch import run_batch as vllm_run_batch
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from edgeq.worker.engine import ChatEngine
    from edgeq.worker.settings import WorkerSettings

    settings = WorkerSettings()
    began = time.perf_counter()
    engine = await ChatEngine.start(settings)
    try:
        await engine.warm_up()
        engine_s = time.perf_counter() - began
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["-i", str(path), "-o", str(out), "--model", settings.model]
        )
        began = time.perf_counter()
        await vllm_run_batch(engine.llm, args)
        run_s = time.perf_counter() - began
    finally:
        engine.shutdown()
    print(json.dumps({"engine_s": engine_s, "run_s": run_s}), flush=True)


async def run_rounds(
    args: argparse.Namespace,
    base: str,
    redis_url: str,
    paths: dict[str, Path],
    env: dict[str, str],
    chats: Sequence[dict[str, Any]],
    scratch: Path,
    processes: Mapping[str, Sequence[psutil.Process]],
) -> list[dict[str, Any]]:
    content = paths["input"].read_bytes()
    rounds: list[dict[str, Any]] = []
    async with ChatClient(redis_url=redis_url, queue=QUEUE) as client:
        # First use of the gateway, the runner and the worker's paths: outside the rounds.
        await edgeq_batch(base, paths["warmup"].read_bytes(), client, chats[:1], processes)
        for number in range(1, args.rounds + 1):
            figures: dict[str, Any] = {}
            order = ("edgeq", "run-batch") if number % 2 else ("run-batch", "edgeq")
            for mode in order:
                if mode == "edgeq":
                    figures["idle_ttfts"] = await interactive_ttfts(client, chats)
                    figures["edgeq"] = await edgeq_batch(base, content, client, chats, processes)
                else:
                    out = scratch / f"run-batch-{number}.jsonl"
                    figures["run-batch"] = await asyncio.to_thread(
                        run_batch, paths["input"], out, env, scratch / "run-batch.log"
                    )
            rounds.append(figures)
            mine, theirs = figures["edgeq"], figures["run-batch"]
            idle = statistics.median(figures["idle_ttfts"])
            mid = statistics.median(mine["mid_ttfts"])
            print(
                f"round {number} ({' then '.join(order)}): edgeq {mine['wall_s']:.1f} s "
                f"({mine['completed']} lines, {mine['tokens']} tokens); run-batch run "
                f"{theirs['run_s']:.1f} s, process {theirs['process_s']:.1f} s "
                f"({theirs['completed']} lines, {theirs['tokens']} tokens); interactive TTFT "
                f"p50 idle {idle:.1f} ms, mid-batch {mid:.1f} ms (chats answered by line "
                f"{mine['lines_done_after_chats']} of {args.lines})",
                flush=True,
            )
    return rounds


def summary(rounds: Sequence[dict[str, Any]]) -> list[str]:
    def shown(pick: Callable[[dict[str, Any]], float], digits: int = 1) -> str:
        return spread_text([pick(r) for r in rounds], digits)

    def mid_over_idle(r: dict[str, Any]) -> float:
        return statistics.median(r["edgeq"]["mid_ttfts"]) / statistics.median(r["idle_ttfts"])

    edgeq, runner = "edgeq", "run-batch"
    cpu = ", ".join(
        f"{name} {shown(lambda r, name=name: r[edgeq]['cpu_s'][name])}"
        for name in rounds[0][edgeq]["cpu_s"]
    )
    job = {
        name: shown(lambda r, name=name: r[edgeq]["line_job"][name], 0)
        for name in ("events", "event_bytes", "result_bytes")
    }
    return [
        f"median [min-max] over {len(rounds)} rounds",
        f"edgeq wall: {shown(lambda r: r[edgeq]['wall_s'])} s",
        f"run-batch run (engine warm): {shown(lambda r: r[runner]['run_s'])} s",
        f"run-batch process (engine start included): {shown(lambda r: r[runner]['process_s'])} s",
        f"output tok/s: edgeq {shown(lambda r: r[edgeq]['tokens'] / r[edgeq]['wall_s'], 0)}, "
        f"run-batch run {shown(lambda r: r[runner]['tokens'] / r[runner]['run_s'], 0)}",
        f"edgeq / run-batch run: x{shown(lambda r: r[edgeq]['wall_s'] / r[runner]['run_s'], 2)} "
        "(target <= 1.10); edgeq / run-batch process: "
        f"x{shown(lambda r: r[edgeq]['wall_s'] / r[runner]['process_s'], 2)}",
        f"interactive TTFT p50: idle {shown(lambda r: statistics.median(r['idle_ttfts']))} ms, "
        f"mid-batch {shown(lambda r: statistics.median(r[edgeq]['mid_ttfts']))} ms, "
        f"mid/idle x{shown(mid_over_idle, 2)} (target <= 1.5)",
        f"edgeq's CPU seconds per batch: {cpu}",
        f"a line's job in Redis after the batch (the last {LINES_SAMPLED} lines): "
        f"{job['events']} events, {job['event_bytes']} bytes of events, "
        f"{job['result_bytes']} bytes of result",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m edgeq.bench.batches", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chats", type=int, default=10, help="interactive chats mid-batch")
    parser.add_argument("--model", help="the model (default: a generated tiny model)")
    parser.add_argument("--vllm-run-batch", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_run_batch:
        asyncio.run(_run_batch_process(*args.vllm_run_batch))
        return

    with tempfile.TemporaryDirectory(prefix="edgeq-bench-batches-") as scratch_dir:
        scratch = Path(scratch_dir)
        model = args.model or str(make_tiny_model(scratch / "model").directory)
        lines = batch_file(model, args.lines, args.max_tokens, seed=0)
        paths = {"input": scratch / "input.jsonl", "warmup": scratch / "warmup.jsonl"}
        paths["input"].write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths["warmup"].write_text("".join(json.dumps(line) + "\n" for line in lines[:8]))
        chats = [
            {"messages": line["body"]["messages"], "max_tokens": 16, "seed": line["body"]["seed"]}
            for line in batch_file(model, args.chats, 16, seed=1)
        ]
        redis = RedisServer().start()
        env = {
            **WORKER_ENV,
            "EDGEQ_MODEL": model,
            "EDGEQ_REDIS_URL": redis.url,
            "EDGEQ_QUEUE": QUEUE,
        }
        worker = WorkerProcess(env, scratch / "worker.log")
        gateway = GatewayProcess(
            {name: env[name] for name in ("EDGEQ_MODEL", "EDGEQ_REDIS_URL", "EDGEQ_QUEUE")},
            scratch / "gateway.log",
        )
        try:
            worker.start().wait_ready()
            gateway.start()
            assert worker.process and gateway.process and redis.process
            gateway_process = psutil.Process(gateway.process.pid)
            processes = {
                "worker": [psutil.Process(worker.process.pid)],
                "engine": [psutil.Process(pid) for pid in engine_pids(worker.process.pid)],
                "gateway": [gateway_process, *gateway_process.children(recursive=True)],
                "redis": [psutil.Process(redis.process.pid)],
            }
            print(f"model {model}; {args.lines} lines, max_tokens {args.max_tokens}; "
                  f"{args.chats} interactive chats; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
            rounds = asyncio.run(
                run_rounds(args, gateway.base_url, redis.url, paths, env, chats, scratch, processes)
            )
        finally:
            gateway.stop()
            worker.stop()
            redis.stop()
    print()
    print("\n".join(summary(rounds)))


if __name__ == "__main__":
    main()
