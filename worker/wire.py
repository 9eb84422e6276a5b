"""The worker's side of arq serialization: the trust boundary for whatever sits in Redis.

The job loop hands every raw job to ``load_job`` (worker/arq_seam.py, ``read_job``). Anything
that is not a well-formed JSON chat job (pickle, garbage, another function name) still becomes
a call to ``chat``, carrying the reason it is unusable, so the job ends with an ``error`` event
on its stream naming the problem instead of a failure only a log would know about. Nothing is
ever unpickled.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from edgeq.core.protocol import JOB_FUNCTION, json_default
from edgeq.core.scheduling import DEFAULT_PRIORITY, DEFAULT_TENANT, PRIORITIES, TENANT_PATTERN


@dataclass(frozen=True)
class JobPayload:
    """The decoded, not yet validated request; or why the raw job could not be decoded."""

    request: Any
    problem: str | None
    size: int

    @property
    def tenant(self) -> str:
        """The tenant the job counts to, read before validation (for counting it while it
        runs); a request without a valid one counts to the default tenant."""
        tenant = self.request.get("tenant") if isinstance(self.request, dict) else None
        # fullmatch: re.match's "$" also matches before a last newline, and "team\n" would
        # then name a Redis key (the usage ledger's) and a metric label.
        if isinstance(tenant, str) and re.fullmatch(TENANT_PATTERN, tenant):
            return tenant
        return DEFAULT_TENANT

    @property
    def key_name(self) -> str:
        """The name of the API key the job came with, read before validation like the
        tenant ('': none, or not a valid name)."""
        name = self.request.get("key_name") if isinstance(self.request, dict) else None
        if isinstance(name, str) and re.fullmatch(TENANT_PATTERN, name):
            return name
        return ""

    @property
    def priority(self) -> str:
        """The class the job was submitted in, read before validation (for its usage ledger
        and metrics); a request without a valid one counts to the default class."""
        priority = self.request.get("priority") if isinstance(self.request, dict) else None
        return priority if priority in PRIORITIES else DEFAULT_PRIORITY

    def __repr__(self) -> str:
        # Whatever logs the job's arguments, a prompt must never reach the log that way.
        state = "unreadable" if self.problem else "chat request"
        return f"<{state}, {self.size} bytes>"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _job(payload: JobPayload, job_try: Any = None, enqueued_ms: Any = None) -> dict[str, Any]:
    return {
        "f": JOB_FUNCTION,
        "a": [payload],
        "k": {},
        "t": job_try if isinstance(job_try, int) and not isinstance(job_try, bool) else None,
        "et": enqueued_ms if _is_positive_number(enqueued_ms) else _now_ms(),
    }


def load_job(raw: bytes) -> dict[str, Any]:
    """The worker's job deserializer (arq's ``job_deserializer``). Never raises, never
    unpickles."""
    size = len(raw)

    def unusable(problem: str) -> dict[str, Any]:
        return _job(JobPayload(request=None, problem=problem, size=size))

    try:
        job = json.loads(raw)
    except UnicodeDecodeError:
        return unusable("the job payload is not UTF-8 JSON (pickle is never accepted)")
    except json.JSONDecodeError as error:
        return unusable(f"the job payload is not valid JSON: {error.msg} at position {error.pos}")
    if not isinstance(job, dict) or not {"f", "a", "k"} <= job.keys():
        return unusable("the job payload is not an arq job object with keys f, a and k")
    if job["f"] != JOB_FUNCTION:
        return unusable(f"unknown job function {job['f']!r}; edgeq runs only {JOB_FUNCTION!r}")
    args, kwargs = job["a"], job["k"]
    if not isinstance(args, list) or len(args) != 1 or kwargs:
        return unusable("a chat job takes exactly one positional argument, the request object")
    payload = JobPayload(request=args[0], problem=None, size=size)
    return _job(payload, job.get("t"), job.get("et"))


def _worker_json_default(value: Any) -> Any:
    if isinstance(value, JobPayload):
        return value.request
    return json_default(value)


def dump_json(value: Any) -> bytes:
    """The worker's result serializer (arq's ``job_serializer``: results keep the job's
    arguments too)."""
    return json.dumps(value, default=_worker_json_default, separators=(",", ":")).encode()
