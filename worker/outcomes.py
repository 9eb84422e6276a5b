"""How a job ends when it ends without an answer: every cause, its error code and its message,
in one table.

Two kinds of cause. A job the loop claimed but could not start (worker/lifecycle.py) has a
``NotStarted`` reason; a job that started and then met an exception has that exception. Both
map here to the one ``error`` event its stream ends with, so the worker knows every job's
outcome where it happens, and no code path builds an error by hand.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from edgeq.core.errors import StreamClosed
from edgeq.core.leases import LOST_MESSAGE
from edgeq.core.protocol import ErrorCode
from edgeq.worker.publisher import RedisAway
from edgeq.worker.settings import WorkerSettings


class JobRefused(Exception):
    """The job cannot run, or must stop: carries the error code and message for its stream."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Ending:
    """The error a job ends with. ``publish`` is False where its stream cannot take it: Redis
    stayed away (its lease runs out and the job is handed over), or the stream already ended
    elsewhere (a cancel, a reaper, another run of the job)."""

    code: ErrorCode
    message: str
    publish: bool = True

    def as_result(self) -> dict[str, str]:
        """The job's result when the error event could not be published (else the event)."""
        return {"type": "error", "code": self.code.value, "message": self.message}


class NotStarted(Enum):
    """Why the loop failed a claimed job without running it."""

    #: Its queue deadline passed before any worker took it (its payload had expired).
    EXPIRED = "expired"
    #: A handed-over job whose payload expired before another worker took it over.
    NOT_CONTINUED_IN_TIME = "not_continued_in_time"
    #: Started more often than EDGEQ_MAX_CONTINUATIONS allows.
    STARTED_TOO_OFTEN = "started_too_often"
    #: An abort (a cancel, arq's ``Job.abort``) was waiting for it when it was claimed.
    ABORTED = "aborted"
    #: Its payload is not an arq job record (the chat's own decoder never raises: worker/wire.py
    #: turns an unusable payload into a request that fails validation, naming the problem).
    UNREADABLE = "unreadable"


_NOT_STARTED: dict[NotStarted, Ending] = {
    NotStarted.EXPIRED: Ending(
        ErrorCode.EXPIRED,
        "the job was not started before its queue deadline (EDGEQ_QUEUE_DEADLINE_S or the "
        "deadline given at submit); it never ran",
    ),
    NotStarted.NOT_CONTINUED_IN_TIME: Ending(
        ErrorCode.WORKER_LOST,
        LOST_MESSAGE.format(why="no worker took it over within EDGEQ_CONTINUE_WITHIN_S"),
    ),
    NotStarted.STARTED_TOO_OFTEN: Ending(
        ErrorCode.WORKER_LOST,
        LOST_MESSAGE.format(why="it was started as often as EDGEQ_MAX_CONTINUATIONS allows"),
    ),
    NotStarted.ABORTED: Ending(ErrorCode.CANCELLED, "the job was aborted before it started"),
    NotStarted.UNREADABLE: Ending(
        ErrorCode.INVALID_REQUEST, "the job payload could not be read as an arq job"
    ),
}


def not_started(reason: NotStarted) -> Ending:
    """The error event of a job the loop could not start."""
    return _NOT_STARTED[reason]


def job_failure(error: BaseException, settings: WorkerSettings, *, draining: bool) -> Ending:
    """The error event of a started job that met ``error``."""
    # Here, not at the top: the job loop imports this table, and vLLM must be imported only
    # after worker/engine.py has set its environment.
    from vllm.v1.engine.exceptions import EngineDeadError

    match error:
        case JobRefused():
            return Ending(error.code, error.message)
        case TimeoutError():
            return Ending(
                ErrorCode.TIMEOUT,
                f"generation did not finish within {settings.job_timeout_s:g} s "
                "(EDGEQ_JOB_TIMEOUT_S)",
            )
        case RedisAway():
            # Nothing can reach the stream; when Redis is back the job's lease runs out and
            # it is continued or ends with worker_lost, which is what the metrics count.
            return Ending(ErrorCode.WORKER_LOST, str(error), publish=False)
        case StreamClosed():
            return Ending(ErrorCode.CANCELLED, "stream closed", publish=False)
        case asyncio.CancelledError() if draining:
            return Ending(
                ErrorCode.SHUTDOWN,
                "the worker shut down and this chat did not finish within its drain time "
                f"(EDGEQ_DRAIN_TIMEOUT_S={settings.drain_timeout_s:g}); safe to retry",
            )
        case asyncio.CancelledError():
            return Ending(ErrorCode.CANCELLED, "the job was aborted before it finished")
        case EngineDeadError():
            return Ending(ErrorCode.ENGINE_ERROR, "the inference engine died; restarting")
        case _:
            return Ending(ErrorCode.ENGINE_ERROR, f"generation failed: {type(error).__name__}")
