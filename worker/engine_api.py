"""What the worker asks of an engine, as a protocol: vLLM's (worker/engine.py ``ChatEngine``)
and the stand-in at a GPU's token rate (edgeq.bench.simulate ``SimulatedEngine``) both
implement it, and nothing in a job's path needs to know which one it holds.

This module imports neither vLLM nor torch: the worker's state and its type hints name the
protocol without loading an engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from edgeq.core.protocol import ChatMessage, ChatRequest
from edgeq.core.scheduling import Priority
from edgeq.core.structured import Tool

if TYPE_CHECKING:  # both import vLLM
    from edgeq.worker.engine import RequestRules
    from edgeq.worker.structured import AnswerReader


class Engine(Protocol):
    """One warm engine for the life of the worker."""

    #: The largest prompt plus answer it holds, in tokens.
    max_model_len: int
    #: How a request becomes SamplingParams here (max_tokens, thinking, the context left).
    rules: RequestRules

    @property
    def device(self) -> str:
        """What it runs on, for ``edgeq status``."""
        ...

    async def warm_up(self) -> None:
        """One short generation, so the first real job does not pay for lazy set-up."""
        ...

    async def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        enable_thinking: bool,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        """Token ids of a chat, rendered with the model's template."""
        ...

    async def encode(self, text: str) -> list[int]:
        """Token ids of plain text (the part of an answer a continued job already has)."""
        ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: Any,
        request_id: str,
        *,
        priority: Priority | None = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[Any, None]:
        """Stream outputs shaped like vLLM's DELTA ``RequestOutput``. Closing the generator
        early (a cancel, a timeout) aborts the request in the engine."""
        ...

    def unfinished_requests(self) -> int:
        """Requests the engine still holds (for the log line of a stopped job)."""
        ...

    def without_step_s(self) -> float:
        """Seconds the engine has held work without making a step; 0 when it holds none
        (worker/liveness.py)."""
        ...

    def answer_reader(self, request: ChatRequest) -> AnswerReader:
        """What turns the streamed text into the answer (tool calls parsed back)."""
        ...

    def shutdown(self) -> None:
        """Stop, returning once the engine's processes are gone (blocking)."""
        ...

    def kill(self) -> None:
        """Kill the engine's processes without asking (a stalled engine), returning once they
        are gone (blocking)."""
        ...
