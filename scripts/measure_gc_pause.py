"""How long one full garbage collection stops a warm worker's event loop: with the start-up
heap frozen (what ``edgeq worker`` does before ``worker_ready``: ``freeze_startup_heap`` in
worker/app.py) and without.

    .venv/bin/python scripts/measure_gc_pause.py [--rounds 5] [--chats 200]

Builds and warms the engine in this process on the tiny model, as the worker does, then
alternates, round by round: unfrozen, serve ``--chats`` chats and time ``gc.collect()``;
frozen, serve as many and time ``gc.collect()`` (which then walks what serving made). Prints
how many objects the collector tracks and the median [min-max] pause of each mode over the
rounds. A full collection is what Python runs now and then on its own once enough objects have
survived two younger ones; while it runs, nothing else in the process does.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.testing.tiny_model import make_tiny_model
from edgeq.worker.app import freeze_startup_heap
from edgeq.worker.engine import ChatEngine
from edgeq.worker.settings import WorkerSettings


def full_collection_ms() -> float:
    began = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - began) * 1000


async def serve(engine: ChatEngine, chats: int) -> None:
    request = ChatRequest(messages=[ChatMessage(role="user", content="A story.")], max_tokens=64)
    prompt = await engine.render(request.messages, enable_thinking=False)
    params = engine.sampling_params(request, len(prompt))

    async def one() -> None:
        async for _ in engine.generate(prompt, params, uuid.uuid4().hex):
            pass

    for _ in range(0, chats, 50):
        await asyncio.gather(*(one() for _ in range(50)))


async def measure(model: Path, rounds: int, chats: int) -> dict[str, list[float]]:
    settings = WorkerSettings(model=str(model), max_model_len=2048, cpu_kv_cache_gib=1)
    engine = await ChatEngine.start(settings)
    try:
        await engine.warm_up()
        pauses: dict[str, list[float]] = {"not frozen": [], "frozen": []}
        for _ in range(rounds):
            gc.unfreeze()
            await serve(engine, chats)
            tracked = len(gc.get_objects())
            pauses["not frozen"].append(full_collection_ms())
            frozen = freeze_startup_heap()
            await serve(engine, chats)
            pauses["frozen"].append(full_collection_ms())
        print(f"objects tracked: {tracked}; frozen by freeze_startup_heap: {frozen}")
        return pauses
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chats", type=int, default=200)
    args = parser.parse_args()
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="edgeq-gc-")) / "tiny-model").directory
    pauses = asyncio.run(measure(model, args.rounds, args.chats))
    print(f"\none full collection, median [min-max] over {args.rounds} rounds, in ms\n")
    for mode, values in pauses.items():
        print(f"{mode}: {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
