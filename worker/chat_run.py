"""One start of a chat on the warm engine (``ChatRun``): prepare the prompt, stream the
answer, publish the done event. The job around it (worker/jobs.py) decides what a failure
means; this module only runs the chat and raises.

``ChatRun`` holds what every step shares (the engine, settings, metrics, publisher, the job's
labels and clocks), so each step takes only what is its own, and ``run`` reads as the chat's
steps in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from pydantic import ValidationError
from vllm import RequestOutput, SamplingParams
from vllm.exceptions import VLLMValidationError

from edgeq.core.events import AnyEvent
from edgeq.core.protocol import (
    ChatRequest,
    ChatResult,
    DeltaEvent,
    DoneEvent,
    ErrorCode,
    Timings,
    Usage,
    describe_validation_error,
    limit_problem,
)
from edgeq.core.scheduling import DEFAULT_TENANT
from edgeq.core.structured import TokenLogprob
from edgeq.worker.adapters import AdapterHost
from edgeq.worker.engine import PromptTooLong
from edgeq.worker.engine_api import Engine
from edgeq.worker.metrics import JobLabels, TokenTally, WorkerMetrics
from edgeq.worker.outcomes import JobRefused
from edgeq.worker.publisher import StreamPublisher
from edgeq.worker.reasoning import ReasoningSplitter
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.structured import (
    AnswerReader,
    constraint_field,
    grammar_problem,
    token_logprobs,
)
from edgeq.worker.wire import JobPayload

log = structlog.get_logger("edgeq.job")


@contextlib.contextmanager
def sooner_or_on_exit(callback: Callable[[], None]) -> Iterator[None]:
    """Run ``callback`` once the event loop is next free, or on leaving the block if that
    comes first (a job that fails before its first suspension logs its start before its
    end)."""
    pending = True

    def run_once() -> None:
        nonlocal pending
        if pending:
            pending = False
            callback()

    asyncio.get_running_loop().call_soon(run_once)  # in this context: the job id stays bound
    try:
        yield
    finally:
        run_once()


def _ms_since(start_s: float, now_s: float) -> float:
    return round((now_s - start_s) * 1000, 3)


def parse_request(payload: JobPayload, settings: WorkerSettings) -> ChatRequest:
    if payload.problem is not None:
        raise JobRefused(ErrorCode.INVALID_REQUEST, payload.problem)
    try:
        request = ChatRequest.model_validate(payload.request)
    except ValidationError as error:
        raise JobRefused(
            ErrorCode.INVALID_REQUEST, f"invalid request: {describe_validation_error(error)}"
        ) from None
    problem = limit_problem(
        request,
        payload.size,
        max_bytes=settings.max_request_bytes,
        max_messages=settings.max_messages,
        max_tokens=settings.max_tokens_limit,
    )
    if problem:
        raise JobRefused(ErrorCode.INVALID_REQUEST, f"invalid request: {problem}")
    return request



@dataclass(frozen=True, slots=True)
class Generation:
    """What one start of a chat asks the engine for."""

    request: ChatRequest
    #: The answer text a dead worker already streamed (a continued job), else "".
    streamed: str
    thinking: bool
    #: The rendered chat, and the streamed answer's tokens that follow it in the prompt.
    chat_prompt: list[int]
    already: list[int]
    #: Tokens the request may still generate (< 1: a continued answer used them all).
    left: int
    #: None: nothing left to generate, or no room left in the context for a continued answer.
    params: SamplingParams | None

    @property
    def prompt(self) -> list[int]:
        return self.chat_prompt + self.already


@dataclass
class Answer:
    """What the engine streamed for one start of a chat."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    completion_tokens: int = 0
    first_token_s: float | None = None
    finish_reason: str = "abort"
    #: The think block's text, when thinking was on.
    reasoning: str | None = None


@dataclass(slots=True)
class ChatRun:
    """One start of a chat job: what its steps (``prepare``, ``stream``, ``finish``) share."""

    engine: Engine
    settings: WorkerSettings
    metrics: WorkerMetrics
    publisher: StreamPublisher
    #: When the job was enqueued (time.time()): its queue time, TTFT and total count from it.
    enqueued_s: float
    #: What a dead worker already published on the job's stream (a continued job), else ().
    earlier: Sequence[AnyEvent] = ()
    #: Starts of the job before this one (a job handed over is continued).
    continued: int = 0
    adapters: AdapterHost | None = None
    #: When this start began (time.time()); set by ``run``.
    started_s: float = 0.0
    #: The job's metric labels; set by ``prepare``.
    labels: JobLabels = field(default_factory=lambda: JobLabels("", ""))

    async def run(self, payload: JobPayload) -> ChatResult:
        """The chat, from its payload to its done event; raises what ends it otherwise."""
        self.started_s = time.time()
        request = parse_request(payload, self.settings)
        # Not streamed: the text waits in the publisher until the end (worker/publisher.py).
        self.publisher.live = request.stream is not False
        adapter = job_adapter(request, self.settings)
        if adapter is not None and self.publisher.ledger is not None:  # the adapter's use
            self.publisher.ledger = replace(self.publisher.ledger, model=adapter)
        # Entered before anything is rendered: a job this worker cannot serve is refused at
        # once, and an adapter in use is not unloaded under it (worker/adapters.py).
        with serving_adapter(self.adapters, adapter) as lora_request:
            generation = await self.prepare(request)
            # The start's metrics and log line (~40 µs of the event loop together) wait until
            # the loop is next free, which is after every job of a claimed burst reached the
            # engine: its first suspension is in stream. Each job of a burst of 50 then cost
            # the loop ~95 µs before the engine instead of ~139 (simulated GPU on a 2-vCPU
            # machine, 2026-12-05).
            with sooner_or_on_exit(lambda: self._announce_start(generation, adapter)):
                answer, tool_calls = await self.stream(generation, lora_request=lora_request)
            return await self.finish(generation, answer, tool_calls)

    async def prepare(self, request: ChatRequest) -> Generation:
        """Render the chat (and a continued answer's streamed part) and build its
        SamplingParams; raises JobRefused for what the request or the engine's context cannot
        take."""
        self.labels = self.metrics.job_labels(request)
        return await prepare_generation(
            self.engine, request, self.earlier, continued=self.continued
        )

    def _announce_start(self, generation: Generation, adapter: str | None) -> None:
        request, continued = generation.request, self.continued
        self.metrics.job_started(
            self.labels,
            queued_s=self.started_s - self.enqueued_s,
            prompt_tokens=len(generation.prompt),
        )
        self.metrics.adapter_job_started(adapter)
        log.info(
            "job_continued" if continued else "job_started",
            queued_ms=_ms_since(self.enqueued_s, self.started_s),
            priority=self.labels.priority,
            tenant=request.tenant,
            **({"adapter": adapter} if adapter else {}),
            prompt_tokens=len(generation.prompt),
            max_tokens=max(generation.left, 0),
            thinking=generation.thinking,
            **(
                {"starts": continued + 1, "answer_tokens_so_far": len(generation.already)}
                if continued
                else {}
            ),
            **({"messages": request.model_dump()["messages"]} if self.settings.log_content
               else {}),
        )  # fmt: skip

    async def stream(
        self, generation: Generation, *, lora_request: Any = None
    ) -> tuple[Answer, list[Any] | None]:
        """Generate and publish the answer's deltas; the answer and its tool calls, if any."""
        request = generation.request
        splitter = ReasoningSplitter(thinking=generation.thinking)
        reader = self.engine.answer_reader(request)
        answer = Answer(
            logprobs=[] if request.logprobs else None,
            finish_reason="abort" if generation.params else "length",
        )
        # The adapter only when there is one: a stand-in engine (bench/simulate.py) takes none.
        adapter = {"lora_request": lora_request} if lora_request is not None else {}
        outputs = (
            self.engine.generate(generation.prompt, generation.params, self.publisher.job_id,
                                 priority=request.priority, **adapter)
            if generation.params
            else _nothing()
        )  # fmt: skip
        tally = self.metrics.token_tally()
        try:
            await self._take_outputs(outputs, answer, request, reader, splitter, tally)
        finally:  # the tokens counted so far reach the metrics, however the job ends
            tally.flush()
        held_back, tool_calls = reader.finish()
        if held_back:
            answer.parts.append(held_back)
            await self.publisher.publish_text(held_back)
        answer.reasoning = splitter.reasoning
        return answer, tool_calls

    async def _take_outputs(
        self,
        outputs: AsyncGenerator[RequestOutput, None],
        answer: Answer,
        request: ChatRequest,
        reader: AnswerReader,
        splitter: ReasoningSplitter,
        tally: TokenTally,
    ) -> None:
        """The per-output loop (the hot path ``python -m edgeq.bench.output_loop`` measures):
        count, publish and keep each output's text."""
        # Locals, not attribute reads, in the loop that runs once per output.
        publisher, metrics, labels = self.publisher, self.metrics, self.labels
        enqueued_s = self.enqueued_s
        # A job that is not streamed publishes nothing until it ends: nobody hears it by design.
        abandon_after_s = self.settings.abandon_after_s if publisher.live else 0.0
        last_tokens_s: float | None = None
        last: RequestOutput | None = None  # the engine's count of the answer's tokens is in it
        summed = 0  # the same, from the outputs' token ids, for an engine that keeps none
        answered = False  # whether the engine sent any output (a grammar error comes before)
        # aclosing: a cancelled or timed-out job aborts its request in the engine at once.
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    answered = True
                    last = output
                    completion = output.outputs[0]
                    if token_ids := completion.token_ids:
                        now_s = time.time()
                        if last_tokens_s is None:
                            answer.first_token_s = now_s
                            metrics.first_token(labels, since_enqueue_s=now_s - enqueued_s)
                            gap_s = None
                        else:
                            gap_s = now_s - last_tokens_s
                        summed += len(token_ids)
                        tally.add(len(token_ids), gap_s=gap_s, now_s=now_s)
                        last_tokens_s = now_s
                    if answer.logprobs is not None:
                        answer.logprobs += token_logprobs(
                            token_ids, completion.logprobs, request.top_logprobs or 0
                        )
                    text = reader.feed(splitter.feed(completion.text))
                    answer.parts.append(text)
                    await publisher.publish_text(text)
                    if abandon_after_s and publisher.unheard_for_s > abandon_after_s:
                        raise _abandoned(abandon_after_s)
                    if output.finished:
                        answer.finish_reason = completion.finish_reason or answer.finish_reason
        except VLLMValidationError as error:
            if answered:
                raise
            # A grammar vLLM cannot compile (it checks when the request is added, before the
            # first output) is the request's fault: invalid_request naming the field. Caught
            # here, not by a generator around the engine's: that one cost every output.
            raise JobRefused(
                ErrorCode.INVALID_REQUEST,
                f"invalid request: {constraint_field(request)}: {grammar_problem(error)}",
            ) from None
        answer.completion_tokens = generated_tokens(last, summed)

    async def finish(
        self, generation: Generation, answer: Answer, tool_calls: list[Any] | None
    ) -> ChatResult:
        """Publish the done event; the job's result."""
        enqueued_s = self.enqueued_s
        timings = Timings(
            queued_ms=_ms_since(enqueued_s, self.started_s),
            ttft_ms=_ms_since(enqueued_s, answer.first_token_s) if answer.first_token_s else None,
            total_ms=_ms_since(enqueued_s, time.time()),
        )
        request = generation.request
        finish_reason = "tool_calls" if tool_calls else answer.finish_reason
        # A continued answer counts the tokens of the text it already had (re-encoded: the
        # dead worker's own count died with it) and reports the chat's prompt alone.
        usage = Usage(
            prompt_tokens=len(generation.chat_prompt),
            completion_tokens=len(generation.already) + answer.completion_tokens,
        )
        done = await self.publisher.publish_done(
            DoneEvent(
                job_id=self.publisher.job_id,
                seq=0,
                finish_reason=finish_reason,
                usage=usage,
                timings=timings,
                reasoning=answer.reasoning if request.return_reasoning and generation.thinking
                else None,
                tool_calls=tool_calls,
                logprobs=answer.logprobs,
                continued=self.continued or None,
            )
        )  # fmt: skip
        text = generation.streamed + "".join(answer.parts)  # a continued answer's earlier part
        log.info(
            "job_done",
            finish_reason=finish_reason,
            completion_tokens=answer.completion_tokens,
            tool_calls=len(tool_calls) if tool_calls else None,
            ttft_ms=timings.ttft_ms,
            total_ms=timings.total_ms,
            **({"text": text} if self.settings.log_content else {}),
        )
        return ChatResult.from_done(done, text)


def generated_tokens(output: Any, summed: int) -> int:
    """Tokens generated: the engine's own per-request count in its last output when it keeps
    one (it stays exact when the engine merges deltas for a consumer that fell behind), else
    ``summed``, the sum of the outputs' token ids."""
    stats = getattr(output, "metrics", None)
    counted = getattr(stats, "num_generation_tokens", None)
    return counted if isinstance(counted, int) else summed


def job_adapter(request: ChatRequest, settings: WorkerSettings) -> str | None:
    """The adapter a job answers with: its own, else its tenant's default (applied here, on
    the worker, so it holds for every producer and for a continued job alike)."""
    if request.adapter is not None:
        return request.adapter
    return settings.tenant_adapters.get(request.tenant or DEFAULT_TENANT)


@contextlib.contextmanager
def serving_adapter(adapters: AdapterHost | None, name: str | None) -> Iterator[Any]:
    """The LoRARequest for ``name`` while the job runs (None: the base model); JobRefused
    (invalid_request, naming it) where this worker cannot serve it."""
    if name is None:
        yield None
        return
    if adapters is None:
        raise JobRefused(
            ErrorCode.INVALID_REQUEST,
            f"invalid request: adapter {name!r} is not served: this worker runs without LoRA "
            f"(EDGEQ_ENABLE_LORA, EDGEQ_ADAPTERS)",
        )
    with adapters.use(name) as lora_request:
        yield lora_request


async def prepare_generation(
    engine: Engine, request: ChatRequest, earlier: Sequence[AnyEvent], *, continued: int
) -> Generation:
    """Render the chat (and a continued answer's streamed part) and build its SamplingParams;
    raises JobRefused for what the request or the engine's context cannot take."""
    streamed = "".join(event.text for event in earlier if isinstance(event, DeltaEvent))
    if continued:
        refuse_continuation(request, streamed)
    rules = engine.rules
    # An answer under way goes on as an answer: no think block before the rest of it.
    thinking = rules.thinking_enabled(request) and not streamed
    tools = request.tools if request.tools_offered else None
    chat_prompt = await engine.render(request.messages, enable_thinking=thinking, tools=tools)
    already = await engine.encode(streamed) if streamed else []
    left = rules.max_tokens(request) - len(already)
    params: SamplingParams | None = None
    if left > 0:
        try:
            params = rules.sampling_params(
                request, len(chat_prompt) + len(already), already=len(already)
            )
        except PromptTooLong as error:
            if not streamed:
                raise JobRefused(ErrorCode.PROMPT_TOO_LONG, str(error)) from None
            # the answer so far fills the context: it ends here
        except VLLMValidationError as error:
            raise JobRefused(ErrorCode.INVALID_REQUEST, f"invalid request: {error}") from None
    return Generation(request, streamed, thinking, chat_prompt, already, left, params)


def _abandoned(abandon_after_s: float) -> JobRefused:
    return JobRefused(
        ErrorCode.CANCELLED,
        f"nobody listened to this job's stream for {abandon_after_s:g} s "
        f"(EDGEQ_ABANDON_AFTER_S); generation was stopped",
    )


def refuse_continuation(request: ChatRequest, streamed: str) -> None:
    """Raise JobRefused(worker_lost) for a handed-over job that must not be continued."""
    if request.on_worker_lost == "fail":
        raise JobRefused(
            ErrorCode.WORKER_LOST,
            "the worker running this job stopped before it finished; it was not continued "
            "because the request asked for on_worker_lost=fail; it is safe to submit it again",
        )
    if streamed and (request.constrained or request.logprobs):
        raise JobRefused(
            ErrorCode.WORKER_LOST,
            "the worker running this job stopped mid-answer, and an answer held to a format "
            "or with logprobs cannot be continued from the middle; it is safe to submit it again",
        )


async def _nothing() -> AsyncGenerator[RequestOutput, None]:
    """No outputs: a continued answer that had already used its max_tokens."""
    return
    yield
