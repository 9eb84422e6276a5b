"""The three ways one request can travel, each timed the same way by a ChunkClock.

- ``QueueTarget``: edgeq's own path, ``ChatClient.submit`` → Redis → arq → worker → pub/sub.
- ``DirectTarget``: the same rendering and SamplingParams as the worker, on an engine in this
  process: what the engine gives without any queue.
- ``OpenAITarget``: ``POST /v1/chat/completions`` with ``stream=true`` on any
  OpenAI-compatible server, read the way vLLM's ``async_request_openai_chat_completions``
  reads it (vllm/benchmarks/lib/endpoint_request_func.py).

A target raises ``RequestFailed`` (or anything else) for a request that did not succeed; the
runner turns that into a failed record, so one bad request never ends a run.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from edgeq.bench.workload import BenchRequest
from edgeq.core.protocol import ChatRequest, DeltaEvent, DoneEvent, ErrorEvent
from edgeq.core.settings import ConnectionSettings, redacted_url
from edgeq.producer.client import ChatClient

if TYPE_CHECKING:
    from edgeq.bench.gpu_rate import GpuRate
    from edgeq.worker.engine_api import Engine
    from edgeq.worker.settings import WorkerSettings

#: How long an OpenAI stream may stay silent: edgeq's default EDGEQ_STREAM_TIMEOUT_S, so both
#: paths give up on a stuck server alike.
HTTP_READ_TIMEOUT_S = 120.0
HTTP_CONNECT_TIMEOUT_S = 10.0
#: An HTTP error body is quoted in the record up to this many characters.
ERROR_BODY_CHARS = 300
#: For the in-process engine: vLLM logs to stdout, which is the bench's table, and its start-up
#: INFO lines drown the progress bar. Warnings still show, on stderr; the variables win if set.
VLLM_LOG_DEFAULTS = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}
SSE_DATA = "data:"
SSE_DONE = "[DONE]"


@contextmanager
def environment_defaults(defaults: Mapping[str, str]) -> Iterator[None]:
    """Set the variables not already set, for the block only (later workers do not inherit)."""
    added = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class RequestFailed(Exception):
    """The server answered, but not with a complete answer; the message says what it sent."""


class ChunkClock:
    """Times one request's chunks as vLLM's request functions do: a first chunk, gaps, an end."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.end: float | None = None
        self.gaps: list[float] = []

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def finish(self) -> None:
        """The answer is complete at a moment that is not a chunk (edgeq's terminal event)."""
        self.end = time.perf_counter()
        if self.first is None:  # an answer without text: it arrived all at once, now
            self.first = self.end

    @property
    def ttft_s(self) -> float:
        if self.first is None:
            raise RequestFailed("no chunk of the answer arrived")
        return self.first - self.sent

    @property
    def e2el_s(self) -> float:
        end = self.end if self.end is not None else self.last
        if end is None:
            raise RequestFailed("no chunk of the answer arrived")
        return end - self.sent


@dataclass(frozen=True)
class Outcome:
    """What a target learnt about a request besides its timing."""

    output_tokens: int
    reported_prompt_tokens: int | None = None
    finish_reason: str | None = None
    queued_ms: float | None = None
    worker_ttft_ms: float | None = None
    worker_total_ms: float | None = None


class Target(Protocol):
    name: str

    @property
    def description(self) -> str: ...

    async def send(
        self, request: BenchRequest, fields: dict[str, Any], clock: ChunkClock
    ) -> Outcome: ...


# --- through edgeq's queue -------------------------------------------------------------------


class QueueTarget:
    """A ChatClient against whichever worker serves the queue; one client for every user."""

    name = "queue"

    def __init__(self, settings: ConnectionSettings, name: str = "queue") -> None:
        self.name = name
        self.settings = settings
        self._client = ChatClient(settings)

    @property
    def description(self) -> str:
        return f"edgeq queue {self.settings.queue} at {redacted_url(self.settings.redis_url)}"

    async def __aenter__(self) -> QueueTarget:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.aclose()

    async def send(
        self, request: BenchRequest, fields: dict[str, Any], clock: ChunkClock
    ) -> Outcome:
        job = await self._client.submit(list(request.messages), **fields)
        async for event in job.stream():
            if isinstance(event, DeltaEvent):
                clock.chunk()
            elif isinstance(event, ErrorEvent):
                raise RequestFailed(f"{event.code}: {event.message}")
            elif isinstance(event, DoneEvent):
                clock.finish()
                return Outcome(
                    output_tokens=event.usage.completion_tokens,
                    reported_prompt_tokens=event.usage.prompt_tokens,
                    finish_reason=event.finish_reason,
                    queued_ms=event.timings.queued_ms,
                    worker_ttft_ms=event.timings.ttft_ms,
                    worker_total_ms=event.timings.total_ms,
                )
        raise RequestFailed("the stream ended without a terminal event")


# --- straight on the engine ------------------------------------------------------------------


class DirectTarget:
    """One engine built in this process from worker settings, warmed up like the worker's;
    with ``gpu``, the worker's stand-in engine at that rate instead (edgeq.bench.simulate)."""

    name = "direct"

    def __init__(self, settings: WorkerSettings, gpu: GpuRate | None = None) -> None:
        self.settings = settings
        self.gpu = gpu
        self._engine: Engine | None = None

    @property
    def description(self) -> str:
        if self.gpu is not None:
            return f"in-process {self.gpu.describe()}"
        return f"in-process engine on {self.settings.model}"

    async def __aenter__(self) -> DirectTarget:
        if self.gpu is not None:
            from edgeq.bench.simulate import SimulatedEngine

            self._engine = await SimulatedEngine.start(self.settings, gpu=self.gpu)
            return self
        # vLLM reads these when it is first imported and when it spawns its engine process.
        with environment_defaults(VLLM_LOG_DEFAULTS):
            from edgeq.worker.engine import ChatEngine  # imports vLLM: only when this mode runs

            # No local name for the engine: this method's frame stays referenced after it
            # returns (seen with vLLM 0.32), and a local there would keep the engine alive
            # until exit, when vLLM's __del__ fails noisily.
            self._engine = await ChatEngine.start(self.settings)
        try:
            await self._engine.warm_up()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    async def send(
        self, request: BenchRequest, fields: dict[str, Any], clock: ChunkClock
    ) -> Outcome:
        engine = self._engine
        if engine is None:
            raise RuntimeError("DirectTarget is used outside its async with block")
        chat = ChatRequest(messages=list(request.messages), **fields)
        # The worker's own two steps before generating (worker/chat_run.py: ChatRun.prepare).
        thinking = engine.rules.thinking_enabled(chat)
        prompt = await engine.render(chat.messages, enable_thinking=thinking)
        params = engine.rules.sampling_params(chat, len(prompt))
        tokens = 0
        finish_reason: str | None = None
        async for output in engine.generate(prompt, params, f"bench-{uuid.uuid4().hex}"):
            completion = output.outputs[0]
            if completion.token_ids:
                clock.chunk()
                tokens += len(completion.token_ids)
            if output.finished:
                finish_reason = completion.finish_reason
        return Outcome(
            output_tokens=tokens, reported_prompt_tokens=len(prompt), finish_reason=finish_reason
        )


# --- an OpenAI-compatible server -------------------------------------------------------------


class OpenAITarget:
    """Streaming chat completions over one pooled HTTP client sized for every user at once."""

    def __init__(
        self,
        base_url: str,
        *,
        users: int,
        model: str,
        count_tokens: Callable[[str], int],
        name: str = "openai",
    ) -> None:
        self.name = name  # the mode's: several servers may run in one bench
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._count_tokens = count_tokens
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            limits=httpx.Limits(max_connections=users, max_keepalive_connections=users),
            timeout=httpx.Timeout(HTTP_READ_TIMEOUT_S, connect=HTTP_CONNECT_TIMEOUT_S),
        )

    @property
    def description(self) -> str:
        return f"OpenAI-compatible server {self.base_url} (model {self.model})"

    async def __aenter__(self) -> OpenAITarget:
        self.model = await self._served_model() or self.model
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    async def _served_model(self) -> str | None:
        """The server's first model name, as vLLM's benchmark asks for it (its --model path)."""
        try:
            response = await self._http.get("/v1/models")
            response.raise_for_status()
            models = response.json().get("data") or []
            return str(models[0]["id"]) if models else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def payload(self, request: BenchRequest, fields: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [message.model_dump() for message in request.messages],
            "max_tokens": fields["max_tokens"],
            "temperature": fields["temperature"],
            "top_p": fields["top_p"],
            "seed": fields["seed"],
            "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM passes these to the chat template: thinking off, as edgeq renders it.
            "chat_template_kwargs": {"enable_thinking": fields["enable_thinking"]},
        }

    async def send(
        self, request: BenchRequest, fields: dict[str, Any], clock: ChunkClock
    ) -> Outcome:
        text: list[str] = []
        usage: dict[str, Any] = {}
        finish_reason: str | None = None
        payload = self.payload(request, fields)
        async with self._http.stream("POST", "/v1/chat/completions", json=payload) as response:
            if response.status_code != httpx.codes.OK:
                body = (await response.aread()).decode(errors="replace")[:ERROR_BODY_CHARS]
                raise RequestFailed(f"HTTP {response.status_code}: {body}")
            async for line in response.aiter_lines():
                # Blank lines end SSE messages; lines starting ":" are comments (keep-alives).
                if not line.startswith(SSE_DATA):
                    continue
                data = line.removeprefix(SSE_DATA).strip()
                if data == SSE_DONE:
                    break
                chunk = json.loads(data)
                if choices := chunk.get("choices"):
                    # vLLM counts every message with choices, the role-only first one included.
                    clock.chunk()
                    text.append(choices[0].get("delta", {}).get("content") or "")
                    finish_reason = choices[0].get("finish_reason") or finish_reason
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                elif "error" in chunk:
                    raise RequestFailed(f"server error mid-stream: {chunk['error']}")
        if clock.first is None:
            raise RequestFailed("never received a chunk with choices")
        output_tokens = usage.get("completion_tokens")
        if not output_tokens:  # no usage from the server: vLLM counts the text's tokens
            output_tokens = self._count_tokens("".join(text))
        return Outcome(
            output_tokens=int(output_tokens),
            reported_prompt_tokens=usage.get("prompt_tokens"),
            finish_reason=finish_reason,
        )
