"""What a producer can be told went wrong. Every message says what happened and where."""

from __future__ import annotations


class EdgeqError(Exception):
    """Base class of every error the edgeq client raises."""


class RedisUnavailable(EdgeqError):
    """Redis could not be reached or stopped answering (the URL in the message is redacted)."""


class QueueFull(EdgeqError):
    """The queue already holds EDGEQ_MAX_QUEUE jobs; nothing was enqueued. Retry later."""


class JobFailed(EdgeqError):
    """The job ended with an ``error`` event; ``code`` is the stable word from the wire contract."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed ({code}): {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class JobTimeout(EdgeqError):
    """No event arrived for a job within the stream timeout."""

    def __init__(self, job_id: str, waited_s: float, detail: str) -> None:
        super().__init__(f"job {job_id}: no event for {waited_s:g} s; {detail}")
        self.job_id = job_id
        self.waited_s = waited_s


class StreamBroken(EdgeqError):
    """The stream broke the contract (a gap in ``seq``): events were lost on the way."""
