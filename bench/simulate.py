"""A simulated GPU box: edgeq's real worker (claim, leases, publisher, metrics) around an
engine that makes tokens at a GPU's rate instead of running a model.

These machines have no GPU, and the tiny model on their CPUs makes tokens 10-100x slower than
Qwen3-0.6B on one; what a GPU box asks of Redis cannot be produced with the real engine here.
So this stand-in replaces vLLM, and only vLLM: every running request gets one token per decode
step of ``step_ms`` (continuous batching: one step serves the whole batch), the first one
``prefill_ms`` after the request arrives, up to the request's ``max_tokens``. A consumer that
falls behind gets the tokens of the steps it missed in one output, as vLLM's DELTA outputs do.

Each token's text is the wall-clock time it was made (``1764639000.1234 ``), so a subscriber
can tell how long the token took to reach it: the last stamp in a delta is the newest token
in it (edgeq.bench.capacity). Stamps are ~16 bytes where a real token is ~4: replay-buffer
memory is reported per event for that reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from edgeq.bench.gpu_rate import GpuRate
from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.core.scheduling import Priority
from edgeq.core.structured import Tool
from edgeq.worker.engine import RequestRules
from edgeq.worker.engine_api import Engine
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.structured import AnswerReader

#: Characters of chat text per simulated prompt token (roughly English text in Qwen3's BPE).
CHARS_PER_TOKEN = 4
#: The context a simulated box accepts when EDGEQ_MAX_MODEL_LEN is not set (Qwen3-0.6B's).
DEFAULT_MAX_MODEL_LEN = 40_960


class DecodeClock:
    """The engine's step loop: one tick per ``step_s`` that wakes every running request."""

    def __init__(self, step_s: float) -> None:
        self._step_s = step_s
        self._tick = asyncio.Event()
        self.steps = 0  # steps completed so far
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        """Safe from any thread (the worker stops its engine off the event loop)."""
        if self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)

    async def next_step(self) -> int:
        """Wait for the next step to complete; the number of steps completed by then."""
        await self._tick.wait()
        return self.steps

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        while True:
            # Against a fixed schedule: a late wake-up does not slow the GPU down.
            await asyncio.sleep(max(0.0, began + (self.steps + 1) * self._step_s - loop.time()))
            self.steps = int((loop.time() - began) / self._step_s)
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()


@dataclass
class SimulatedCompletion:
    """The part of vLLM's CompletionOutput that edgeq's job reads."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: None = None


@dataclass
class SimulatedOutput:
    """The part of vLLM's RequestOutput that edgeq's job reads (no per-request stats: the job
    then counts the outputs' token ids)."""

    outputs: list[SimulatedCompletion]
    finished: bool
    metrics: None = None


class SimulatedEngine:
    """An engine (worker/engine_api.py) with vLLM's request rules (sampling params, thinking
    and max-token rules: ``RequestRules``) and rendering, tokenizing and generation
    simulated. No tokenizer: requests with tools are rendered without them and their answers
    are never tool calls."""

    def __init__(self, settings: WorkerSettings, gpu: GpuRate) -> None:
        self.settings = settings
        self.gpu = gpu
        self.max_model_len = settings.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.rules = RequestRules(settings, max_model_len=self.max_model_len)
        self._requests: set[str] = set()
        self._clock = DecodeClock(gpu.step_ms / 1000)
        self._clock.start()

    @classmethod
    async def start(cls, settings: WorkerSettings, *, gpu: GpuRate | None = None) -> Engine:
        return cls(settings, gpu or GpuRate())

    @property
    def device(self) -> str:
        return self.gpu.describe()

    async def warm_up(self) -> None:
        return None

    def shutdown(self) -> None:
        self._clock.stop()

    def kill(self) -> None:
        self._clock.stop()

    def unfinished_requests(self) -> int:
        return len(self._requests)

    def without_step_s(self) -> float:
        return 0.0  # its clock never stops while the worker runs

    def answer_reader(self, request: ChatRequest) -> AnswerReader:
        return AnswerReader(request, None)

    async def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        enable_thinking: bool,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        characters = sum(len(message.content or "") for message in messages)
        return [0] * (characters // CHARS_PER_TOKEN + len(messages))

    async def encode(self, text: str) -> list[int]:
        return [0] * (len(text) // CHARS_PER_TOKEN)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: Any,
        request_id: str,
        *,
        priority: Priority | None = None,
    ) -> AsyncGenerator[SimulatedOutput, None]:
        self._requests.add(request_id)
        try:
            await asyncio.sleep(self.gpu.prefill_ms / 1000)
            wanted: int = params.max_tokens
            made, seen_step = 0, self._clock.steps
            while made < wanted:
                tokens = 1
                if made:  # after the first: one per step, and every step missed meanwhile,
                    # held (as vLLM's stream_interval holds them) until EDGEQ_STREAM_TOKENS came.
                    tokens = 0
                    while tokens < min(self.settings.stream_tokens, wanted - made):
                        step = await self._clock.next_step()
                        tokens, seen_step = tokens + step - seen_step, step
                    tokens = min(tokens, wanted - made)
                made += tokens
                text = "x " * (tokens - 1) + f"{time.time():.4f} "
                finished = made >= wanted
                completion = SimulatedCompletion(
                    text=text, token_ids=[0] * tokens, finish_reason="length" if finished else None
                )
                yield SimulatedOutput(outputs=[completion], finished=finished)
        finally:
            self._requests.discard(request_id)
