"""Where a burst's time goes, stage by stage: N chats submitted at once from one ChatClient.

    .venv/bin/python scripts/measure_burst.py [--sizes 1 10 50] [--rounds 3] [--direct]

Starts a private Redis and one worker on the tiny model, then for each round sends a burst of
each size (alternating: 1, 10, 50, 1, 10, 50, ...) and prints, per size, the median over the
rounds of each burst's p50 (with the rounds' min-max):

- submit: ``ChatClient.submit`` returning (validate, SUBSCRIBE, enqueue);
- enqueue -> start: the worker's ``queued_ms`` (claim, arq's job start, the request parsed);
- enqueue -> first token: the worker's ``ttft_ms`` (render, engine prefill, first sample);
- client TTFT: submit called -> first delta in hand.

``--direct`` sends the same bursts to an engine built in this process instead (the bench's
direct mode: the worker's rendering and sampling settings, no Redis): only client TTFT.

Each mode also prints the CPU time per chat of the processes that are not the engine's, over
the whole measurement (the idle second between bursts included): the worker (its event loop,
render thread and vLLM's output handling), this script (the client) and Redis; in direct
mode, this script (which then holds vLLM's output handling and the render thread).

The worker's two figures are on the worker's clock from the job's enqueue time, the client's
on the client's; both run on this machine. Prompts are 50-220 words, answers ``--max-tokens``
(256; 1 isolates what starting a job costs).

``--simulate-gpu`` runs ``edgeq simulate-box`` (the worker around a stand-in engine at a GPU's
rate, edgeq.bench.simulate; ``--direct``: that engine in this process): what the queue costs
when the engine leaves the cores free, as on a GPU box.

``--profile FILE`` samples the worker's process with py-spy (``pip install py-spy``) for the
whole measurement and writes its collapsed stacks (one ``frame;frame;... count`` line each) to
FILE; ``--top`` prints the functions the worker's main thread spent the most samples in.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from edgeq.bench.cpu import process_cpu_s
from edgeq.bench.gpu_rate import GpuRate, worker_process
from edgeq.bench.targets import ChunkClock, DirectTarget
from edgeq.bench.workload import BenchRequest
from edgeq.core.protocol import ChatMessage, DeltaEvent, DoneEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer, tiny_model_env
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.settings import WorkerSettings

QUEUE = "edgeq:measure-burst"
WORDS = "the small worker reads a job from the queue and asks the model for an answer".split()
STAGES = ("submit", "enqueue -> start", "enqueue -> first token (worker)", "client TTFT")
DIRECT_STAGES = ("client TTFT",)
Chat = Callable[[str, int], Awaitable[tuple[float, ...]]]  # (prompt, seed) -> stages in ms


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 220)))


async def one_chat(client: ChatClient, text: str, seed: int, max_tokens: int) -> tuple[float, ...]:
    started = time.perf_counter()
    job = await client.submit(text, max_tokens=max_tokens, seed=seed, temperature=0.5)
    submitted = time.perf_counter()
    first: float | None = None
    done: DoneEvent | None = None
    async for event in job.stream():
        if isinstance(event, DeltaEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, DoneEvent):
            done = event
    assert done is not None and first is not None and done.timings.ttft_ms is not None
    return (
        (submitted - started) * 1000,
        done.timings.queued_ms,
        done.timings.ttft_ms,
        (first - started) * 1000,
    )


async def one_direct_chat(
    engine: DirectTarget, text: str, seed: int, max_tokens: int
) -> tuple[float, ...]:
    clock = ChunkClock()
    request = BenchRequest(
        index=0, messages=(ChatMessage(role="user", content=text),), prompt_tokens=0, seed=seed
    )
    await engine.send(request, {"max_tokens": max_tokens, "seed": seed, "temperature": 0.5}, clock)
    return (clock.ttft_s * 1000,)


async def measure(chat: Chat, sizes: list[int], rounds: int) -> dict[int, list[tuple[float, ...]]]:
    rng = random.Random(0)
    p50s: dict[int, list[tuple[float, ...]]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            texts = [prompt(rng) for _ in range(size)]
            chats = await asyncio.gather(*(chat(text, 100 + n) for n, text in enumerate(texts)))
            stages = zip(*chats, strict=True)
            p50s[size].append(tuple(statistics.median(stage) for stage in stages))
            await asyncio.sleep(1.0)  # back to idle
    return p50s


async def measure_queue(
    url: str, sizes: list[int], rounds: int, max_tokens: int
) -> dict[int, list[tuple[float, ...]]]:
    async with ChatClient(redis_url=url, queue=QUEUE, max_queue=0) as client:
        await client.chat("warm up", max_tokens=4)
        return await measure(
            lambda text, seed: one_chat(client, text, seed, max_tokens), sizes, rounds
        )


async def measure_direct(
    settings: WorkerSettings,
    sizes: list[int],
    rounds: int,
    max_tokens: int,
    gpu: GpuRate | None,
) -> tuple[dict[int, list[tuple[float, ...]]], float]:
    """The stages, and this process's CPU seconds over them (the engine's warm-up excluded)."""
    async with DirectTarget(settings, gpu) as engine:
        before_s = process_cpu_s(os.getpid())
        p50s = await measure(
            lambda text, seed: one_direct_chat(engine, text, seed, max_tokens), sizes, rounds
        )
        return p50s, process_cpu_s(os.getpid()) - before_s


def print_stages(
    stages: Sequence[str], p50s: dict[int, list[tuple[float, ...]]], rounds: int
) -> None:
    print(f"p50 of each burst, median [min-max] over {rounds} rounds, in ms\n")
    print("| N | " + " | ".join(stages) + " |")
    print("|---|" + "---|" * len(stages))
    for size, rows in p50s.items():
        cells = []
        for stage in zip(*rows, strict=True):
            cells.append(f"{statistics.median(stage):.1f} [{min(stage):.1f}-{max(stage):.1f}]")
        print(f"| {size} | " + " | ".join(cells) + " |")


def run_direct(args: argparse.Namespace, model: Path) -> int:
    settings = WorkerSettings(model=str(model), max_model_len=2048, cpu_kv_cache_gib=1)
    p50s, cpu_s = asyncio.run(
        measure_direct(settings, args.sizes, args.rounds, args.max_tokens, simulated_gpu(args))
    )
    print_stages(DIRECT_STAGES, p50s, args.rounds)
    chats = args.rounds * sum(args.sizes)
    print(f"\nCPU per chat (ms): this process (engine client) {cpu_s / chats * 1000:.2f}")
    return 0


def simulated_gpu(args: argparse.Namespace) -> GpuRate | None:
    return GpuRate() if args.simulate_gpu else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--profile", type=Path, help="write py-spy's collapsed stacks here")
    parser.add_argument("--top", type=int, default=25, help="functions to print with --profile")
    parser.add_argument("--direct", action="store_true", help="an engine in this process")
    parser.add_argument("--simulate-gpu", action="store_true", help="a stand-in engine (30 ms)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="edgeq-burst-"))
    model = make_tiny_model(scratch / "tiny-model").directory
    if args.direct:
        return run_direct(args, model)
    redis_server = RedisServer().start()
    env = tiny_model_env(model, redis_server.url, QUEUE) | {"EDGEQ_MAX_MODEL_LEN": "2048"}
    worker = worker_process(env, scratch / "worker.log", simulated_gpu(args)).start()
    sampler: subprocess.Popen[bytes] | None = None
    try:
        worker.wait_ready()
        if args.profile:
            py_spy = str(Path(sys.executable).with_name("py-spy"))
            sampler = subprocess.Popen(
                [py_spy, "record", "--pid", str(worker.process.pid), "--rate", "250",
                 "--format", "raw", "--output", str(args.profile), "--nonblocking"]
            )  # fmt: skip
            time.sleep(1.0)  # attached
        processes = {
            "worker": worker.process.pid,
            "this process (client)": os.getpid(),
            "Redis": redis_server.process.pid,
        }
        before_s = {name: process_cpu_s(pid) for name, pid in processes.items()}
        p50s = asyncio.run(
            measure_queue(redis_server.url, args.sizes, args.rounds, args.max_tokens)
        )
        used_s = {name: process_cpu_s(pid) - before_s[name] for name, pid in processes.items()}
    finally:
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            sampler.wait(timeout=30)
        worker.stop()
        redis_server.stop()
    print_stages(STAGES, p50s, args.rounds)
    chats = args.rounds * sum(args.sizes) + 1  # and the warm-up chat
    per_chat = ", ".join(f"{name} {cpu_s / chats * 1000:.2f}" for name, cpu_s in used_s.items())
    print(f"\nCPU per chat (ms): {per_chat}")
    if args.profile:
        print_top(args.profile, args.top)
    return 0


def print_top(collapsed: Path, top: int) -> None:
    """Per function, the share of the event loop thread's samples it was on the stack for
    (inclusive) and at the top of it (self)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(frame.startswith("BaseEventLoop.run_forever") for frame in frames):
            continue  # another thread's
        samples = int(count)
        total += samples
        for frame in set(frames[1:]):
            inclusive[frame] += samples
        own[frames[-1]] += samples
    print(f"\nworker event loop: {total} samples; inclusive % / self % per function")
    for frame, samples in inclusive.most_common(top):
        print(f"{100 * samples / total:5.1f} {100 * own[frame] / total:5.1f}  {frame}")


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    sys.exit(main())
