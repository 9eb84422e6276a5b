"""The chat job: run one chat on the warm engine and publish its events.

Every path out of ``chat`` publishes exactly one terminal event: ``done`` with usage and
timings, or ``error`` with a stable code (worker/outcomes.py). The same terminal outcome is
the job's arq result (worker/arq_seam.py). The one exception is a dead engine: the job is
then handed over unended (its engine failure counted on it first), for another worker, or this
one restarted, to continue; at two such failures the hand-over quarantines it instead.

A job the loop starts for the second time was handed over after its worker (or its worker's
engine) died (core/leases.py): its stream already holds what the dead worker published. It is
continued: the prompt is the chat plus the answer text streamed so far, and its new text
follows the old in the same stream, under the next ``seq``. What cannot be continued from the
middle (a constrained answer, logprobs, ``on_worker_lost="fail"``) ends with ``worker_lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from pydantic import ValidationError
from vllm import RequestOutput, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from edgeq.core.connection import REDIS_ERRORS
from edgeq.core.errors import StreamClosed
from edgeq.core.events import AnyEvent, StreamTaken, read_events
from edgeq.core.leases import hand_over_after_engine_failure
from edgeq.core.ledger import LedgerScope
from edgeq.core.limits import settle_ended
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
from edgeq.worker.lifecycle import StartedJob
from edgeq.worker.metrics import JobLabels, WorkerMetrics
from edgeq.worker.outcomes import Ending, JobRefused, job_failure
from edgeq.worker.publisher import RedisAway, StreamPublisher
from edgeq.worker.reasoning import ReasoningSplitter
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.state import WorkerState
from edgeq.worker.structured import constraint_field, grammar_problem, token_logprobs
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


async def chat(state: WorkerState, job: StartedJob) -> dict[str, Any]:
    """The job function the loop runs (worker/lifecycle.py); ``job.payload`` comes from
    ``edgeq.worker.wire.load_job``. Returns the job's result: the answer, or its error event."""
    payload: JobPayload = job.payload
    continued = job.job_try - 1  # starts before this one
    settings, metrics = state.settings, state.metrics
    structlog.contextvars.bind_contextvars(job_id=job.job_id)
    earlier = await read_events(state.redis, job.job_id) if continued else []
    publisher = StreamPublisher(
        state.events,
        job.job_id,
        interval_s=settings.stream_interval_ms / 1000,
        outage_limit_s=settings.redis_outage_s,
        earlier=earlier,
        tenant=payload.tenant,
        ledger=LedgerScope(payload.tenant, settings.model, payload.priority),
    )
    state.running[job.job_id] = payload.tenant
    outcome = ErrorCode.ENGINE_ERROR.value  # what the metrics count unless a path says better
    e2e_s: float | None = None  # for jobs that end with done
    usage: Usage | None = None
    try:
        async with asyncio.timeout(settings.job_timeout_s):
            result = await run_chat(
                state.ready_engine, settings, metrics, publisher, payload,
                job.enqueued_ms / 1000, earlier=earlier, continued=continued,
                adapters=state.adapters,
            )  # fmt: skip
        # The same clock reading as the done event's total_ms: metric and event agree.
        outcome, e2e_s, usage = "done", result.timings.total_ms / 1000, result.usage
        return result.model_dump(mode="json", exclude_none=True)
    except (Exception, asyncio.CancelledError) as error:
        ending = job_failure(error, settings, draining=state.draining.is_set())
        outcome = ending.code.value
        failure = await _end_with(publisher, ending, error, state)
        if isinstance(error, asyncio.CancelledError | EngineDeadError):
            raise
        return failure
    finally:
        metrics.job_ended(outcome, e2e_s=e2e_s)
        if job.job_id not in state.not_finished_here:  # else it ends (and counts) elsewhere
            metrics.tenant_job_ended(payload.tenant, outcome, usage)
            if publisher.closed:
                state.recent.keep_events(
                    job.job_id, publisher.stored, payload.tenant, publisher.ledger
                )
            # Its tokens, reserved at admission (core/limits.py).
            await settle_ended(
                state.redis, settings.queue, job.job_id, payload.tenant, publisher.stored
            )
        # No more renewals; the lease itself goes with arq's records, when the loop finishes
        # them (worker/lifecycle.py): released here, it left records Redis could not take
        # (an outage at the job's end) in the queue and in progress for good (#34).
        state.running.pop(job.job_id, None)
        structlog.contextvars.unbind_contextvars("job_id")


# Causes whose error event says all there is (job_failed logs it): no traceback for them.
_ENDINGS_LOGGED_ELSEWHERE = (JobRefused, TimeoutError, asyncio.CancelledError, EngineDeadError)


async def _end_with(
    publisher: StreamPublisher, ending: Ending, error: BaseException, state: WorkerState
) -> dict[str, Any]:
    """Publish a failed job's error event (where its stream can take one), log why, and do
    what its cause asks beyond that."""
    if isinstance(error, StreamClosed):
        # Someone else ended the stream (a cancel, or a reaper that thought us lost), or took
        # it over (we were thought dead): the generation was abandoned, which aborted its
        # engine request.
        taken = isinstance(error, StreamTaken)
        if taken:
            state.not_finished_here.add(publisher.job_id)  # the records are the other run's
        log.info(
            "job_stopped",
            reason="another run of the job took its stream"
            if taken
            else "its stream was ended elsewhere (cancel or worker_lost)",
            engine_unfinished_requests=state.ready_engine.unfinished_requests(),
        )
    elif isinstance(error, RedisAway):
        # No terminal event could go out: the records and the lease stay, and the lease's
        # expiry, once Redis is back, continues the job or ends it worker_lost. Finished
        # here, the job was gone with no end for its client to see (#34, the CI campaign).
        state.not_finished_here.add(publisher.job_id)
        log.warning("job_abandoned", reason=ending.message)
    elif not isinstance(error, _ENDINGS_LOGGED_ELSEWHERE):
        log.exception("job_error")
    if isinstance(error, EngineDeadError):
        await _hand_over_from_dead_engine(state, publisher.job_id)
    failure = await _fail(publisher, ending) if ending.publish else ending.as_result()
    if isinstance(error, EngineDeadError):
        log.error("engine_dead", action="stopping worker so its supervisor restarts it")
        state.engine_died = True
        os.kill(os.getpid(), signal.SIGTERM)
    return failure


async def _hand_over_from_dead_engine(state: WorkerState, job_id: str) -> None:
    """A job whose engine died is continued by another worker (or this one restarted), like
    a killed worker's, and not ended: the chat most likely did not kill the engine. The
    death is counted on it first (a job at two is quarantined, core/leases.py), and its
    lease let run out at once, so the next keep-alive round anywhere hands it over."""
    state.running.pop(job_id, None)  # no renewal after the expiry below
    state.not_finished_here.add(job_id)  # its records stay for the next run
    with contextlib.suppress(*REDIS_ERRORS):  # else its lease runs out by itself
        await hand_over_after_engine_failure(state.redis, state.settings.queue, [job_id])


async def _fail(publisher: StreamPublisher, ending: Ending) -> dict[str, Any]:
    log.info("job_failed", code=ending.code.value, reason=ending.message)
    if publisher.closed:  # the terminal event is out; a second one would break the contract
        return ending.as_result()
    try:
        event = await asyncio.shield(publisher.publish_error(ending.code.value, ending.message))
    except (StreamClosed, RedisAway):
        return ending.as_result()
    return event.model_dump(mode="json")


def generated_tokens(output: Any, counted_so_far: int) -> int:
    """Tokens generated so far: the engine's own per-request count when it keeps one (it
    stays exact when the engine merges deltas for a consumer that fell behind), else the sum
    of the deltas' token ids."""
    stats = getattr(output, "metrics", None)
    counted = getattr(stats, "num_generation_tokens", None)
    if isinstance(counted, int):
        return counted
    return counted_so_far + len(output.outputs[0].token_ids)


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


async def run_chat(
    engine: Engine,
    settings: WorkerSettings,
    metrics: WorkerMetrics,
    publisher: StreamPublisher,
    payload: JobPayload,
    enqueued_s: float,
    *,
    earlier: Sequence[AnyEvent] = (),
    continued: int = 0,
    adapters: AdapterHost | None = None,
) -> ChatResult:
    started_s = time.time()
    request = parse_request(payload, settings)
    # Not streamed: the text waits in the publisher until the end (worker/publisher.py).
    publisher.live = request.stream is not False
    adapter = job_adapter(request, settings)
    if adapter is not None and publisher.ledger is not None:  # counted as the adapter's use
        publisher.ledger = replace(publisher.ledger, model=adapter)
    # Entered before anything is rendered: a job this worker cannot serve is refused at once,
    # and an adapter in use is not unloaded under it (worker/adapters.py).
    with serving_adapter(adapters, adapter) as lora_request:
        return await _run_chat(
            engine, settings, metrics, publisher, request, enqueued_s, started_s,
            earlier=earlier, continued=continued, adapter=adapter, lora_request=lora_request,
        )  # fmt: skip


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


async def _run_chat(
    engine: Engine,
    settings: WorkerSettings,
    metrics: WorkerMetrics,
    publisher: StreamPublisher,
    request: ChatRequest,
    enqueued_s: float,
    started_s: float,
    *,
    earlier: Sequence[AnyEvent],
    continued: int,
    adapter: str | None,
    lora_request: Any,
) -> ChatResult:
    generation = await prepare_generation(engine, request, earlier, continued=continued)
    labels = metrics.job_labels(request)

    def announce_start() -> None:
        metrics.job_started(
            labels, queued_s=started_s - enqueued_s, prompt_tokens=len(generation.prompt)
        )
        metrics.adapter_job_started(adapter)
        log.info(
            "job_continued" if continued else "job_started",
            queued_ms=_ms_since(enqueued_s, started_s),
            priority=labels.priority,
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
            **({"messages": request.model_dump()["messages"]} if settings.log_content else {}),
        )

    # The start's metrics and log line (~40 µs of the event loop together) wait until the loop is
    # next free, which is after every job of a claimed burst reached the engine: its first
    # suspension is in stream_answer. Each job of a burst of 50 then cost the loop ~95 µs
    # before the engine instead of ~139 (simulated GPU on a 2-vCPU machine, 2026-12-05).
    with sooner_or_on_exit(announce_start):
        answer, tool_calls = await stream_answer(
            engine, generation, publisher, settings, metrics, labels, enqueued_s,
            lora_request=lora_request,
        )  # fmt: skip
    return await finish_chat(
        publisher, settings, generation, answer, tool_calls, continued=continued,
        timings=Timings(
            queued_ms=_ms_since(enqueued_s, started_s),
            ttft_ms=_ms_since(enqueued_s, answer.first_token_s) if answer.first_token_s else None,
            total_ms=_ms_since(enqueued_s, time.time()),
        ),
    )  # fmt: skip


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


async def stream_answer(
    engine: Engine,
    generation: Generation,
    publisher: StreamPublisher,
    settings: WorkerSettings,
    metrics: WorkerMetrics,
    labels: JobLabels,
    enqueued_s: float,
    *,
    lora_request: Any = None,
) -> tuple[Answer, list[Any] | None]:
    """Generate and publish the answer's deltas; the answer and its tool calls, if any."""
    request = generation.request
    splitter = ReasoningSplitter(thinking=generation.thinking)
    reader = engine.answer_reader(request)
    answer = Answer(
        logprobs=[] if request.logprobs else None,
        finish_reason="abort" if generation.params else "length",
    )
    last_tokens_s: float | None = None
    tally = metrics.token_tally()
    # The adapter only when there is one: a stand-in engine (bench/simulate.py) takes none.
    adapter = {"lora_request": lora_request} if lora_request is not None else {}
    outputs = (
        engine.generate(generation.prompt, generation.params, publisher.job_id,
                        priority=request.priority, **adapter)
        if generation.params
        else _nothing()
    )  # fmt: skip
    answered = False  # whether the engine sent any output (a grammar error comes before)
    # aclosing: a cancelled or timed-out job aborts its request in the engine at once.
    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                answered = True
                completion = output.outputs[0]
                if completion.token_ids:
                    now_s = time.time()
                    if last_tokens_s is None:
                        answer.first_token_s = now_s
                        metrics.first_token(labels, since_enqueue_s=now_s - enqueued_s)
                        gap_s = None
                    else:
                        gap_s = now_s - last_tokens_s
                    tally.add(len(completion.token_ids), gap_s=gap_s, now_s=now_s)
                    last_tokens_s = now_s
                answer.completion_tokens = generated_tokens(output, answer.completion_tokens)
                if answer.logprobs is not None:
                    answer.logprobs += token_logprobs(
                        completion.token_ids, completion.logprobs, request.top_logprobs or 0
                    )
                text = reader.feed(splitter.feed(completion.text))
                answer.parts.append(text)
                await publisher.publish_text(text)
                _refuse_if_unheard(publisher, settings)
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
    finally:  # the tokens counted so far reach the metrics, however the job ends
        tally.flush()
    held_back, tool_calls = reader.finish()
    if held_back:
        answer.parts.append(held_back)
        await publisher.publish_text(held_back)
    answer.reasoning = splitter.reasoning
    return answer, tool_calls


def _refuse_if_unheard(publisher: StreamPublisher, settings: WorkerSettings) -> None:
    # A job that is not streamed publishes nothing until it ends: nobody hears it by design.
    if not publisher.live:
        return
    if settings.abandon_after_s and publisher.unheard_for_s > settings.abandon_after_s:
        raise JobRefused(
            ErrorCode.CANCELLED,
            f"nobody listened to this job's stream for {settings.abandon_after_s:g} s "
            f"(EDGEQ_ABANDON_AFTER_S); generation was stopped",
        )


async def finish_chat(
    publisher: StreamPublisher,
    settings: WorkerSettings,
    generation: Generation,
    answer: Answer,
    tool_calls: list[Any] | None,
    *,
    continued: int,
    timings: Timings,
) -> ChatResult:
    """Publish the done event; the job's result."""
    request = generation.request
    finish_reason = "tool_calls" if tool_calls else answer.finish_reason
    # A continued answer counts the tokens of the text it already had (re-encoded: the
    # dead worker's own count died with it) and reports the chat's prompt alone.
    usage = Usage(
        prompt_tokens=len(generation.chat_prompt),
        completion_tokens=len(generation.already) + answer.completion_tokens,
    )
    done = await publisher.publish_done(
        DoneEvent(
            job_id=publisher.job_id,
            seq=0,
            finish_reason=finish_reason,
            usage=usage,
            timings=timings,
            reasoning=answer.reasoning if request.return_reasoning and generation.thinking
            else None,
            tool_calls=tool_calls,
            logprobs=answer.logprobs,
            continued=continued or None,
        )
    )  # fmt: skip
    text = generation.streamed + "".join(answer.parts)  # a continued answer's earlier part too
    log.info(
        "job_done",
        finish_reason=finish_reason,
        completion_tokens=answer.completion_tokens,
        tool_calls=len(tool_calls) if tool_calls else None,
        ttft_ms=timings.ttft_ms,
        total_ms=timings.total_ms,
        **({"text": text} if settings.log_content else {}),
    )
    return ChatResult.from_done(done, text)


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
