"""What one measured request is, and what one mode's run of the whole workload is.

Every runner fills the same record, so the metrics, the report and the plot never need to know
which way a request travelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds on the client's monotonic clock.

    A chunk is one piece of the answer as it arrives: an SSE message with ``choices``, an
    engine output with new tokens, an edgeq ``delta`` event. For a successful request
    ``ttft_s + sum(itl_s) <= e2el_s``, with equality where the last chunk ends the answer
    (``vllm bench serve``'s rule); edgeq's stream ends with its terminal event instead.
    """

    index: int
    user: int
    success: bool
    #: When the request was sent, from the start of the mode's run (for timelines).
    start_s: float
    #: Request sent → first chunk of the answer.
    ttft_s: float = 0.0
    #: Request sent → the answer is complete (last chunk, or edgeq's terminal event).
    e2el_s: float = 0.0
    #: Gaps between consecutive chunks after the first (one chunk may hold several tokens).
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    #: The prompt length the workload built; ``reported_prompt_tokens`` is the server's count.
    prompt_tokens: int = 0
    reported_prompt_tokens: int | None = None
    finish_reason: str | None = None
    #: edgeq queue modes only: the worker's ``done.timings`` (ms since the enqueue).
    queued_ms: float | None = None
    worker_ttft_ms: float | None = None
    worker_total_ms: float | None = None
    error: str | None = None

    @property
    def input_tokens(self) -> int:
        """The server's prompt count when it reported one (vLLM's rule), else the workload's."""
        if self.reported_prompt_tokens is not None:
            return self.reported_prompt_tokens
        return self.prompt_tokens

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_s"] = list(self.itl_s)
        return data


@dataclass
class ModeRun:
    """One mode's pass over the workload: its requests and the wall time they took together."""

    name: str
    #: Where the requests went: a Redis URL and queue, an engine, an HTTP URL.
    target: str
    duration_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    #: CPU time this process spent during the run: near ``duration_s`` means the load
    #: generator itself was the bottleneck (with --direct it includes the engine's front end).
    client_cpu_s: float = 0.0
    #: CPU seconds the mode's other processes used during the run, by role: ``engine``
    #: (vLLM's processes), and for a worker the bench started ``worker`` (its own process)
    #: and ``redis``.
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: Set when the mode could not run at all (its warm-up request failed, its worker died).
    error: str | None = None
    #: For a worker started by the bench: the settings it was given and its ready event.
    worker: dict[str, Any] | None = None
