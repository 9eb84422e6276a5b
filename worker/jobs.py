"""The arq job: run one chat on the warm engine and publish its events.

Every path out of ``chat`` publishes exactly one terminal event: ``done`` with usage and
timings, or ``error`` with a stable code. The same terminal outcome is the arq job result.

A job arq starts for the second time was handed over after its worker died
(core/leases.py): its stream already holds what the dead worker published. It is continued:
the prompt is the chat plus the answer text streamed so far, and its new text follows the
old in the same stream, under the next ``seq``. What cannot be continued from the middle (a
constrained answer, logprobs, ``on_worker_lost="fail"``) ends with ``worker_lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any

import structlog
from pydantic import ValidationError
from vllm import RequestOutput, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from edgeq.core.errors import StreamClosed
from edgeq.core.events import AnyEvent, StreamTaken, read_events
from edgeq.core.leases import release_lease, renew_leases
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
from edgeq.core.structured import TokenLogprob
from edgeq.worker.engine import ChatEngine, PromptTooLong
from edgeq.worker.metrics import WorkerMetrics
from edgeq.worker.publisher import RedisAway, StreamPublisher
from edgeq.worker.reasoning import ReasoningSplitter
from edgeq.worker.settings import WorkerSettings
from edgeq.worker.state import worker_state
from edgeq.worker.structured import constraint_field, grammar_problem, token_logprobs
from edgeq.worker.wire import JobPayload

log = structlog.get_logger("edgeq.job")


class JobRefused(Exception):
    """The job cannot run; carries the error code and message for its stream."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


async def chat(ctx: dict[str, Any], payload: JobPayload) -> dict[str, Any]:
    """arq entry point; ``payload`` comes from ``edgeq.worker.wire.load_job``."""
    job_id: str = ctx["job_id"]  # arq's per-job keys
    enqueued_s = ctx["enqueue_time"].timestamp()
    continued = int(ctx.get("job_try") or 1) - 1  # starts before this one
    state = worker_state(ctx)
    settings, metrics = state.settings, state.metrics
    structlog.contextvars.bind_contextvars(job_id=job_id)
    earlier = await read_events(state.redis, job_id) if continued else []
    publisher = StreamPublisher(
        state.events,
        job_id,
        interval_s=settings.stream_interval_ms / 1000,
        outage_limit_s=settings.redis_outage_s,
        earlier=earlier,
        tenant=payload.tenant,
    )
    state.running[job_id] = payload.tenant
    outcome = ErrorCode.ENGINE_ERROR.value  # what the metrics count unless a path says better
    e2e_s: float | None = None  # for jobs that end with done
    try:
        # The fast claim leased the job as it took it; arq's own claim does not, so lease it
        # at once: a worker killed from here on is noticed (README, "Guarantees").
        if not settings.fast_pickup:
            await renew_leases(state.redis, settings.queue, [job_id], ttl_s=settings.lease_ttl_s)
        async with asyncio.timeout(settings.job_timeout_s):
            result = await run_chat(
                state.ready_engine,
                settings,
                metrics,
                publisher,
                payload,
                enqueued_s,
                earlier=earlier,
                continued=continued,
            )
        # The same clock reading as the done event's total_ms: metric and event agree.
        outcome, e2e_s = "done", result.timings.total_ms / 1000
        return result.model_dump(mode="json", exclude_none=True)
    except JobRefused as refusal:
        outcome = refusal.code.value
        return await _fail(publisher, refusal.code, refusal.message)
    except TimeoutError:
        outcome = ErrorCode.TIMEOUT.value
        return await _fail(
            publisher,
            ErrorCode.TIMEOUT,
            f"generation did not finish within {settings.job_timeout_s:g} s (EDGEQ_JOB_TIMEOUT_S)",
        )
    except RedisAway as away:
        # Nothing can reach the stream; when Redis is back, its lease runs out and the job is
        # continued or ends with worker_lost, which is what the metrics count.
        log.warning("job_abandoned", reason=str(away))
        outcome = ErrorCode.WORKER_LOST.value
        return {"type": "error", "code": outcome, "message": str(away)}
    except StreamClosed as closed:
        # Someone else ended the stream (a cancel, or a reaper that thought us lost), or took
        # it over (we were thought dead): the generation was abandoned, which aborted its
        # engine request.
        if isinstance(closed, StreamTaken):
            state.superseded.add(job_id)
        log.info(
            "job_stopped",
            reason="another run of the job took its stream"
            if isinstance(closed, StreamTaken)
            else "its stream was ended elsewhere (cancel or worker_lost)",
            engine_unfinished_requests=state.ready_engine.llm.get_num_unfinished_requests(),
        )
        outcome = ErrorCode.CANCELLED.value
        return {"type": "error", "code": ErrorCode.CANCELLED.value, "message": "stream closed"}
    except asyncio.CancelledError:
        if state.draining.is_set():
            code, message = (
                ErrorCode.SHUTDOWN,
                f"the worker shut down and this chat did not finish within its drain time "
                f"(EDGEQ_DRAIN_TIMEOUT_S={settings.drain_timeout_s:g}); safe to retry",
            )
        else:
            code, message = ErrorCode.CANCELLED, "the job was aborted before it finished"
        outcome = code.value
        await _fail(publisher, code, message)
        raise
    except EngineDeadError:
        await _fail(publisher, ErrorCode.ENGINE_ERROR, "the inference engine died; restarting")
        log.error("engine_dead", action="stopping worker so its supervisor restarts it")
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    except Exception as error:
        log.exception("job_error")
        return await _fail(
            publisher, ErrorCode.ENGINE_ERROR, f"generation failed: {type(error).__name__}"
        )
    finally:
        metrics.job_ended(outcome, e2e_s=e2e_s)
        state.running.pop(job_id, None)
        if job_id not in state.superseded:  # else the lease is the other run's
            await asyncio.shield(_release(state.redis, settings.queue, job_id))
        structlog.contextvars.unbind_contextvars("job_id")


async def _release(redis: Any, queue: str, job_id: str) -> None:
    try:
        await release_lease(redis, queue, job_id)
    except Exception:  # Redis away: the lease expires and the reaper finds the terminal event
        log.warning("lease_release_failed")


async def _fail(publisher: StreamPublisher, code: ErrorCode, message: str) -> dict[str, Any]:
    log.info("job_failed", code=code.value, reason=message)
    failure = {"type": "error", "code": code.value, "message": message}
    if publisher.closed:  # the terminal event is out; a second one would break the contract
        return failure
    try:
        event = await asyncio.shield(publisher.publish_error(code.value, message))
    except (StreamClosed, RedisAway):
        return failure
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


async def run_chat(
    engine: ChatEngine,
    settings: WorkerSettings,
    metrics: WorkerMetrics,
    publisher: StreamPublisher,
    payload: JobPayload,
    enqueued_s: float,
    *,
    earlier: Sequence[AnyEvent] = (),
    continued: int = 0,
) -> ChatResult:
    started_s = time.time()
    request = parse_request(payload, settings)
    streamed = "".join(event.text for event in earlier if isinstance(event, DeltaEvent))
    if continued:
        refuse_continuation(request, streamed)
    # An answer under way goes on as an answer: no think block before the rest of it.
    thinking = engine.thinking_enabled(request) and not streamed
    tools = request.tools if request.tools_offered else None
    chat_prompt = await engine.render(request.messages, enable_thinking=thinking, tools=tools)
    already = await engine.encode(streamed) if streamed else []
    prompt = chat_prompt + already
    left = engine.max_tokens(request) - len(already)  # < 1: the answer so far used it all
    params: SamplingParams | None = None
    if left > 0:
        try:
            params = engine.sampling_params(request, len(prompt), already=len(already))
        except PromptTooLong as error:
            if not streamed:
                raise JobRefused(ErrorCode.PROMPT_TOO_LONG, str(error)) from None
            left = 0  # the answer so far fills the context: it ends here
        except VLLMValidationError as error:
            raise JobRefused(ErrorCode.INVALID_REQUEST, f"invalid request: {error}") from None
    labels = metrics.job_labels(request)

    def announce_start() -> None:
        metrics.job_started(labels, queued_s=started_s - enqueued_s, prompt_tokens=len(prompt))
        log.info(
            "job_continued" if continued else "job_started",
            queued_ms=_ms_since(enqueued_s, started_s),
            priority=labels.priority,
            tenant=request.tenant,
            prompt_tokens=len(prompt),
            max_tokens=max(left, 0),
            thinking=thinking,
            **(
                {"starts": continued + 1, "answer_tokens_so_far": len(already)} if continued else {}
            ),
            **({"messages": request.model_dump()["messages"]} if settings.log_content else {}),
        )

    splitter = ReasoningSplitter(thinking=thinking)
    answer_reader = engine.answer_reader(request)
    answer: list[str] = []
    logprobs: list[TokenLogprob] | None = [] if request.logprobs else None
    completion_tokens = 0
    first_token_s: float | None = None
    last_tokens_s: float | None = None
    finish_reason = "abort" if left > 0 else "length"
    # aclosing: a cancelled or timed-out job aborts its request in the engine at once.
    outputs = (
        engine.generate(prompt, params, publisher.job_id, priority=request.priority)
        if params
        else _nothing()
    )
    # The start's metrics and log line (~40 µs of the event loop together) wait until the loop is
    # next free, which is after every job of a claimed burst reached the engine: its first
    # suspension is in the loop below (docs/benchmarks.md, "Where the milliseconds go").
    with sooner_or_on_exit(announce_start):
        async with contextlib.aclosing(_refusing_invalid(outputs, request)) as outputs:
            async for output in outputs:
                completion = output.outputs[0]
                if completion.token_ids:
                    now_s = time.time()
                    first_token_s = first_token_s or now_s
                    metrics.tokens_arrived(
                        labels,
                        len(completion.token_ids),
                        gap_s=None if last_tokens_s is None else now_s - last_tokens_s,
                        since_enqueue_s=now_s - enqueued_s,
                    )
                    last_tokens_s = now_s
                completion_tokens = generated_tokens(output, completion_tokens)
                if logprobs is not None:
                    logprobs += token_logprobs(
                        completion.token_ids, completion.logprobs, request.top_logprobs or 0
                    )
                text = answer_reader.feed(splitter.feed(completion.text))
                answer.append(text)
                await publisher.publish_text(text)
                if settings.abandon_after_s and publisher.unheard_for_s > settings.abandon_after_s:
                    raise JobRefused(
                        ErrorCode.CANCELLED,
                        f"nobody listened to this job's stream for {settings.abandon_after_s:g} s "
                        f"(EDGEQ_ABANDON_AFTER_S); generation was stopped",
                    )
                if output.finished:
                    finish_reason = completion.finish_reason or finish_reason

    held_back, tool_calls = answer_reader.finish()
    if held_back:
        answer.append(held_back)
        await publisher.publish_text(held_back)
    if tool_calls:
        finish_reason = "tool_calls"
    finished_s = time.time()
    timings = Timings(
        queued_ms=_ms_since(enqueued_s, started_s),
        ttft_ms=_ms_since(enqueued_s, first_token_s) if first_token_s else None,
        total_ms=_ms_since(enqueued_s, finished_s),
    )
    # A continued answer counts the tokens of the text it already had (re-encoded: the
    # dead worker's own count died with it) and reports the chat's prompt alone.
    usage = Usage(
        prompt_tokens=len(chat_prompt), completion_tokens=len(already) + completion_tokens
    )
    reasoning = splitter.reasoning if request.return_reasoning and thinking else None
    done = await publisher.publish_done(
        DoneEvent(
            job_id=publisher.job_id,
            seq=0,
            finish_reason=finish_reason,
            usage=usage,
            timings=timings,
            reasoning=reasoning,
            tool_calls=tool_calls,
            logprobs=logprobs,
            continued=continued or None,
        )
    )
    text = streamed + "".join(answer)  # the whole answer, a continued one's earlier part too
    log.info(
        "job_done",
        finish_reason=finish_reason,
        completion_tokens=completion_tokens,
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


async def _refusing_invalid(
    outputs: AsyncGenerator[RequestOutput, None], request: ChatRequest
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs; a grammar vLLM cannot compile (it checks when the request is
    added, before the first output) becomes an invalid_request naming the field."""
    async with contextlib.aclosing(outputs):
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            return
        except VLLMValidationError as error:
            raise JobRefused(
                ErrorCode.INVALID_REQUEST,
                f"invalid request: {constraint_field(request)}: {grammar_problem(error)}",
            ) from None
        yield first
        async for output in outputs:
            yield output
