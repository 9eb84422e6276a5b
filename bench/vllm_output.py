"""A simulated GPU box that runs vLLM's own output processing: the ceiling of one worker.

``edgeq.bench.simulate``'s stand-in replaces all of vLLM, so a box built on it skips the work
AsyncLLM does in the worker's process for every token: detokenizing, building RequestOutputs,
its output handler and per-request stats. This one replaces only vLLM's engine core (the
process that runs the model): the worker runs its real ``ChatEngine`` and, in it, a real
``AsyncLLM`` (its InputProcessor, OutputProcessor with the model's tokenizer, output handler
and stat loggers), whose engine core client is ``SimulatedCore``: it makes one token per
running request per decode step of ``step_ms``, the first ``prefill_ms`` after the request
arrives, and hands them to AsyncLLM as the real client does, as ``EngineCoreOutputs``.

The token ids cycle through an English sentence tokenized with the model's own tokenizer, so
the detokenizer does its real work. So that a subscriber can still tell how long a token took
to reach it, ``ProcessedEngine.generate`` appends a mark to each output's (real) text: the
tokens in the output and the time the newest of them was made, ``|3@1764639000.1234|``
(edgeq.bench.capacity reads it). That wrapper (one generator resume and a string append per
output) and the marks' bytes are the only work here a real box would not do.

Not simulated: decoding the core's msgpack frames off its socket (a real box's worker pays it;
building the outputs here stands in for it) and the engine core process's own CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.metrics.stats import SchedulerStats

from edgeq.bench.gpu_rate import GpuRate
from edgeq.core.scheduling import Priority
from edgeq.worker.engine import ChatEngine
from edgeq.worker.settings import WorkerSettings

#: What the simulated model says, over and over: ordinary words, so detokenizing costs what
#: it costs on text (no "|", which marks a token's time).
SENTENCE = "The sea was calm that morning, and the boats went out before the sun rose. "


def sentence_token_ids(tokenizer: Any, sentence: str = SENTENCE) -> list[int]:
    return list(tokenizer.encode(sentence, add_special_tokens=False))


def mark(tokens: int, made_s: float) -> str:
    """What ``ProcessedEngine`` appends to an output's text (edgeq.bench.capacity parses it)."""
    return f"|{tokens}@{made_s:.4f}|"


@dataclass
class _Running:
    """A request the simulated core holds."""

    request_id: str  # vLLM's internal id (the one its outputs carry)
    max_tokens: int
    first_step_s: float  # loop time its first token is due (after the prefill)
    made_s: list[float]  # wall time each token was made (shared with ProcessedEngine)
    made: int = 0


@dataclass
class SimulatedCore:
    """Stands in for AsyncLLM's ``AsyncMPClient``: the part of it AsyncLLM calls while
    serving chats, with a step loop in this process instead of an engine core process."""

    gpu: GpuRate
    token_ids: Sequence[int]
    #: Per external request id, the wall time each token was made, for the marks.
    made_s: dict[str, list[float]] = field(default_factory=dict)
    engine_ranks_managed: list[int] = field(default_factory=lambda: [0])
    #: AsyncLLM reads ``resources.engine_dead`` to tell a dead core from a failed request.
    resources: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(engine_dead=False))
    steps: int = 0  # decode steps made so far
    _running: dict[str, _Running] = field(default_factory=dict)
    _outputs: asyncio.Queue[EngineCoreOutputs] = field(default_factory=asyncio.Queue)
    _task: asyncio.Task[None] | None = None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None:  # started on first use: AsyncLLM is built off the event loop
            self._task = loop.create_task(self._run())
        self.admit(request, loop.time())

    def admit(self, request: EngineCoreRequest, now_s: float) -> None:
        """Hold ``request`` from ``now_s`` (loop time): its first token after the prefill."""
        external = request.external_req_id or request.request_id
        params = request.sampling_params
        self._running[request.request_id] = _Running(
            request_id=request.request_id,
            max_tokens=params.max_tokens if params and params.max_tokens else 16,
            first_step_s=now_s + self.gpu.prefill_ms / 1000,
            made_s=self.made_s.setdefault(external, []),
        )

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        if self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)

    def step(self, now_s: float) -> EngineCoreOutputs:
        """One decode step: a token for every request whose prefill is done."""
        outputs: list[EngineCoreOutput] = []
        made_s = time.time()
        for running in list(self._running.values()):
            if running.first_step_s > now_s:
                continue
            token = self.token_ids[running.made % len(self.token_ids)]
            running.made += 1
            running.made_s.append(made_s)
            done = running.made >= running.max_tokens
            if done:
                del self._running[running.request_id]
            outputs.append(
                EngineCoreOutput(
                    request_id=running.request_id,
                    new_token_ids=[token],
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
        self.steps += 1
        # The real core sends its scheduler's stats every step (AsyncLLM's loggers read them).
        stats = SchedulerStats(num_running_reqs=len(self._running))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        began, step_s = loop.time(), self.gpu.step_ms / 1000
        for n in itertools.count(1):
            # Against a fixed schedule: a late wake-up does not slow the GPU down, and every
            # step missed meanwhile still sends its own outputs, as a real core's would queue
            # on its socket while the worker is busy.
            await asyncio.sleep(max(0.0, began + n * step_s - loop.time()))
            if self._running:
                self._outputs.put_nowait(self.step(loop.time()))


class ProcessedEngine(ChatEngine):
    """edgeq's real ``ChatEngine`` (AsyncLLM included) around a ``SimulatedCore``."""

    core: SimulatedCore
    gpu: GpuRate

    @classmethod
    async def start(
        cls, settings: WorkerSettings, *, gpu: GpuRate | None = None
    ) -> ProcessedEngine:
        rate = gpu or GpuRate()
        made: list[SimulatedCore] = []

        def simulated_client(*args: Any, renderer: Any = None, **kwargs: Any) -> SimulatedCore:
            made.append(SimulatedCore(rate, sentence_token_ids(renderer.tokenizer)))
            return made[0]

        # The one seam: AsyncLLM asks this factory for its engine core client.
        with mock.patch.object(
            EngineCoreClient, "make_async_mp_client", staticmethod(simulated_client)
        ):
            engine = await super().start(settings)
        assert isinstance(engine, ProcessedEngine)  # ChatEngine.start builds a ``cls``
        engine.core, engine.gpu = made[0], rate
        return engine

    @property
    def device(self) -> str:
        return f"vLLM's output processing, {self.gpu.describe()}"

    def kill(self) -> None:
        self.core.shutdown()

    async def generate(  # type: ignore[override]
        self,
        prompt_token_ids: list[int],
        params: Any,
        request_id: str,
        *,
        priority: Priority | None = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[Any, None]:
        made_s = self.core.made_s.setdefault(request_id, [])
        outputs = super().generate(
            prompt_token_ids, params, request_id, priority=priority, lora_request=lora_request
        )
        tokens = 0
        try:
            # aclosing: closing this generator (a cancel) closes AsyncLLM's, which aborts.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    completion = output.outputs[0]
                    if completion.token_ids:
                        tokens += len(completion.token_ids)
                        completion.text += mark(len(completion.token_ids), made_s[tokens - 1])
                    yield output
        finally:
            self.core.made_s.pop(request_id, None)
