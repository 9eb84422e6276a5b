"""The worker's own CPU per engine output: its job loop (``worker/chat_run.py``: ``ChatRun.stream``)
over ready-made outputs, with nothing else in the process.

    .venv/bin/python -m edgeq.bench.output_loop [--jobs 400] [--tokens 256] [--rounds 5]

A stand-in engine hands each job ``--tokens`` DELTA outputs of one token each (vLLM's shape,
as with EDGEQ_STREAM_TOKENS=1), each after one turn of the event loop, as AsyncLLM's queue
does; the publisher is the real one (coalescing at EDGEQ_STREAM_INTERVAL_MS's default) over an
event log that stores nothing; metrics, reasoning split and answer reader are the real ones.
So a round's CPU per output is what edgeq's code costs for each token, without vLLM's output
processing, Redis or the engine: the part of the worker's per-token CPU that edgeq can change.
On a busy machine the end-to-end figure (``edgeq bench``'s "front CPU µs/token") moves by more
than this whole part between rounds; this one is steady enough to compare two versions of the
loop. docs/performance.md states its figures; tests/test_bench_output_loop.py runs it briefly.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from edgeq.core.events import AnyEvent, Published
from edgeq.core.ledger import LedgerScope
from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.worker import chat_run
from edgeq.worker.metrics import WorkerMetrics
from edgeq.worker.publisher import StreamPublisher
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.structured import AnswerReader

#: Jobs run once, unmeasured, before the measured ones (first calls, caches).
WARMUP_JOBS = 5
#: Each output's text: about one token's worth.
TOKEN_TEXT = "ab"
US_PER_S = 1e6


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: None = None


@dataclass
class _Stats:
    num_generation_tokens: int


@dataclass
class _Output:
    outputs: list[_Completion]
    finished: bool
    metrics: _Stats


class _NoStore:
    """An event log that takes every event and stores nothing (one listener each)."""

    async def append_many(
        self,
        events: list[AnyEvent],
        *,
        at_seq: bool = False,
        tenant: str | None = None,
        ledger: LedgerScope | None = None,
        ledger_keep_s: int | None = None,
    ) -> list[Published]:
        return [Published(seq=event.seq, listeners=1) for event in events]


class _ReadyEngine:
    """Hands out ``tokens`` one-token outputs per request, one loop turn apart."""

    def __init__(self, tokens: int) -> None:
        self._outputs = [
            _Output(
                [_Completion(TOKEN_TEXT, [7], "length" if n == tokens else None)],
                finished=n == tokens,
                metrics=_Stats(n),
            )
            for n in range(1, tokens + 1)
        ]

    def answer_reader(self, request: ChatRequest) -> AnswerReader:
        return AnswerReader(request, None)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[_Output, None]:
        async def outputs() -> AsyncGenerator[_Output, None]:
            for output in self._outputs:
                await asyncio.sleep(0)  # the job waits for each output, as on AsyncLLM's queue
                yield output

        return outputs()


async def _one_job(
    engine: _ReadyEngine, settings: WorkerSettings, metrics: WorkerMetrics, tokens: int, n: int
) -> None:
    request = ChatRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=tokens)
    # Any params at all: the stand-in engine reads none, and a job without any generates nothing.
    params: Any = object()
    generation = chat_run.Generation(request, "", False, [1, 2, 3], [], tokens, params)
    log: Any = _NoStore()
    publisher = StreamPublisher(
        log, f"output-loop-{n}", interval_s=settings.stream_interval_ms / 1000
    )
    stand_in: Any = engine
    run = chat_run.ChatRun(stand_in, settings, metrics, publisher, time.time())
    run.labels = metrics.job_labels(request)
    await run.stream(generation)


async def _round(jobs_: int, tokens: int) -> float:
    """CPU µs per output of ``jobs_`` concurrent jobs of ``tokens`` outputs each."""
    settings = WorkerSettings(model="stand-in")
    metrics = WorkerMetrics(CollectorRegistry())
    engine = _ReadyEngine(tokens)
    await asyncio.gather(
        *(_one_job(engine, settings, metrics, tokens, n) for n in range(WARMUP_JOBS))
    )
    cpu_s = time.process_time()
    await asyncio.gather(*(_one_job(engine, settings, metrics, tokens, n) for n in range(jobs_)))
    return US_PER_S * (time.process_time() - cpu_s) / (jobs_ * tokens)


def measure(*, jobs_: int, tokens: int, rounds: int) -> list[float]:
    """Each round's CPU µs per output."""
    return [asyncio.run(_round(jobs_, tokens)) for _ in range(rounds)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=400, help="concurrent jobs (default: 400)")
    parser.add_argument("--tokens", type=int, default=256, help="outputs per job (default: 256)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    per_output = measure(jobs_=args.jobs, tokens=args.tokens, rounds=args.rounds)
    print(
        f"worker job loop: {statistics.median(per_output):.2f} "
        f"[{min(per_output):.2f}-{max(per_output):.2f}] CPU µs per output over "
        f"{args.rounds} rounds of {args.jobs} jobs x {args.tokens} outputs"
    )


if __name__ == "__main__":
    main()
