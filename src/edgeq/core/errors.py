"""Every error edgeq raises, in one tree: catch ``EdgeqError`` for all of them.

    EdgeqError
    ├── ConfigError        a setting edgeq cannot run with (the message names the variable)
    ├── InvalidRequest     refused before it was enqueued (also a ValueError)
    │   └── PoisonRefused  the same request was quarantined as a poison job, within
    │                      EDGEQ_POISON_REFUSE_S: refused at the door
    ├── RedisUnavailable   Redis unreachable, or it refused the credentials
    ├── QueueFull          EDGEQ_MAX_QUEUE jobs already queued or running, or the tenant's
    │                      EDGEQ_TENANT_MAX_QUEUED queued: retry later
    │   └── RateLimited    the tenant's rate limit or token budget is spent (``refusal``)
    ├── IdempotencyConflict  a submit's idempotency key was given to a different request
    ├── JobFailed          the job ended with an ``error`` event (``code``, ``message``)
    ├── InvalidAnswer      a ``schema=`` answer was cut short or does not validate
    ├── JobTimeout         no event within the stream timeout
    ├── StreamBroken       a gap in ``seq``: events were lost on the way
    └── StreamClosed       the job's stream already holds its terminal event

Every message says what happened and where.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any


class EdgeqError(Exception):
    """Base class of every error edgeq raises."""


class ConfigError(EdgeqError):
    """A setting has a value edgeq cannot run with; the message names the variable."""


class InvalidRequest(EdgeqError, ValueError):
    """The request was refused before it was enqueued; the message names the field."""


class PoisonRefused(InvalidRequest):
    """The same request (the same fingerprint: core/fingerprint.py) was quarantined as a
    poison job (``job_id``) less than EDGEQ_POISON_REFUSE_S ago; nothing was enqueued. It is
    refused for ``retry_after_s`` more, unless an operator lifts it (``edgeq dead-letter retry``
    or ``drop``). Sending it again unchanged would likely take down engines again."""

    def __init__(self, job_id: str, fingerprint: str, left_s: float) -> None:
        until = datetime.fromtimestamp(time.time() + left_s, UTC).isoformat(timespec="seconds")
        super().__init__(
            f"request: the same request (fingerprint {fingerprint[:16]}) was quarantined as a "
            f"poison job ({job_id}: it was running on engines that died or stalled), so it is "
            f"refused until {until} ({math.ceil(left_s)} s more, EDGEQ_POISON_REFUSE_S); "
            f"nothing was enqueued. An operator lifts the refusal with `edgeq dead-letter "
            f"drop {job_id}` or `edgeq dead-letter retry {job_id}`"
        )
        self.job_id = job_id
        self.fingerprint = fingerprint
        self.left_s = left_s

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the refusal ends (at least 1)."""
        return max(1, math.ceil(self.left_s))


class RedisUnavailable(EdgeqError):
    """Redis could not be reached or stopped answering (the URL in the message is redacted)."""


class QueueFull(EdgeqError):
    """The queue already holds EDGEQ_MAX_QUEUE jobs, or the job's tenant its cap of queued
    jobs (EDGEQ_TENANT_MAX_QUEUED); nothing was enqueued. Retry later."""


class RateLimited(QueueFull):
    """The tenant's requests or tokens per minute, or its token budget for the UTC day or
    month, would be exceeded, or those of the named API key it came with (docs/limits.md);
    nothing was enqueued. ``refusal`` says which limit and whose, its value, what is left and
    when it resets (a core/limits.py RateLimitRefusal)."""

    def __init__(self, tenant: str, refusal: Any, key_name: str | None = None) -> None:
        super().__init__(
            f"{refusal.whose(tenant, key_name)} is over its "
            f"{refusal.limit.replace('_', ' ')} limit ({refusal.value}, {refusal.setting}; "
            f"{refusal.remaining} left): try again in {math.ceil(refusal.reset_s)} s"
        )
        self.tenant = tenant
        self.key_name = key_name
        self.refusal = refusal

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the refusing limit's window turns (at least 1)."""
        return max(1, math.ceil(self.refusal.reset_s))


class IdempotencyConflict(EdgeqError):
    """A submit's idempotency key was already given, within EDGEQ_IDEMPOTENCY_TTL_S, to a job
    with a different request (``job_id``); nothing was enqueued. A new request needs a new key."""

    def __init__(self, key: str, tenant: str, job_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} of tenant {tenant} was given to job {job_id} with a "
            f"different request; nothing was enqueued (a new request needs a new key)"
        )
        self.key = key
        self.tenant = tenant
        self.job_id = job_id


class JobFailed(EdgeqError):
    """The job ended with an ``error`` event; ``code`` is the stable word from the wire contract."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed ({code}): {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class InvalidAnswer(EdgeqError):
    """``chat(..., schema=Model)`` got an answer that is not a ``Model``: cut off by
    max_tokens, or failing a rule the grammar could not enforce. ``result`` is the answer."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


class JobTimeout(EdgeqError):
    """No event arrived for a job within the stream timeout."""

    def __init__(self, job_id: str, waited_s: float, detail: str) -> None:
        super().__init__(f"job {job_id}: no event for {waited_s:g} s; {detail}")
        self.job_id = job_id
        self.waited_s = waited_s


class StreamBroken(EdgeqError):
    """The stream broke the contract (a gap in ``seq``): events were lost on the way."""


class StreamClosed(EdgeqError):
    """The job's stream already holds its terminal event; nothing more is accepted."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: its stream has already ended")
        self.job_id = job_id
