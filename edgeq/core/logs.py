"""Structured JSON logs for the worker and the gateway: structlog for our events, stdlib
records (arq, uvicorn) rendered the same way, one JSON object per line on stderr.

Rendering and writing happen on a thread of their own (the stdlib's QueueHandler and
QueueListener): the caller only builds the event and puts it on a queue. A worker's event loop
logs twice per job; rendering and writing a line there cost it 25 µs (stderr to /dev/null) to
35-50 µs (to a pipe), paid by every chat of a burst queued behind it, against 16-21 µs now
(docs/benchmarks.md); and a stderr that stops taking lines (a stalled journald) would have
stopped every stream. What must be read where the event happens is read there: the time, the
job's bound context, a stdlib record's message. Lines still queued at exit are written before
the process ends (``atexit``); only a SIGKILL can lose them.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import logging.handlers
import queue
import sys
from typing import Any, Literal

import structlog

LogLevel = Literal["debug", "info", "warning", "error"]

# Run by the caller, for our own events.
_STRUCTLOG_PROCESSORS: list[structlog.typing.Processor] = [
    structlog.contextvars.merge_contextvars,  # binds job_id to every event of a job
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    # log.exception's traceback is the caller's current exception: render it while there is
    # one (costs nothing on a line without exc_info).
    structlog.processors.format_exc_info,
]

# Set on a stdlib record by the queue handler: the caller's bound context (the job's id).
_CONTEXT_ATTRIBUTE = "edgeq_context"

# The running set-up: the writer thread, and the handler it writes with.
_listener: logging.handlers.QueueListener | None = None
_writer: logging.Handler | None = None


def _merge_record_context(
    logger: Any, method_name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """merge_contextvars for a stdlib record rendered on the writer thread: the context the
    caller had bound when it logged, not the writer thread's (empty) one."""
    context = getattr(event_dict.get("_record"), _CONTEXT_ATTRIBUTE, None) or {}
    for key, value in context.items():
        event_dict.setdefault(key, value)
    return event_dict


def _stamp_record_time(
    logger: Any, method_name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """The record's own creation time, as TimeStamper(fmt="iso", utc=True) writes it, not the
    moment the writer thread got to it."""
    created = datetime.datetime.fromtimestamp(event_dict["_record"].created, datetime.UTC)
    event_dict["timestamp"] = created.isoformat().replace("+00:00", "Z")
    return event_dict


class _HandOffHandler(logging.handlers.QueueHandler):
    """Puts records on the writer thread's queue as they are: structlog's event dicts are
    rendered there. The stdlib's QueueHandler formats each record in the caller first (for
    queues to other processes), which is the cost this handler exists to move."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if not isinstance(record.msg, dict):  # a stdlib logger's record: freeze it now
            record.msg, record.args = record.getMessage(), None
            setattr(record, _CONTEXT_ATTRIBUTE, structlog.contextvars.get_contextvars())
        return record


def configure_logging(level: str) -> None:
    """JSON lines on stderr at ``level`` and above, rendered and written off the caller's
    thread. Calling it again replaces the previous set-up (its queued lines are written)."""
    global _listener, _writer
    stop_logging()
    structlog.configure(
        processors=[
            *_STRUCTLOG_PROCESSORS,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            _merge_record_context,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            _stamp_record_time,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    )
    _writer = logging.StreamHandler(sys.stderr)
    _writer.setFormatter(formatter)
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, _writer)
    _listener.start()
    root = logging.getLogger()
    root.handlers = [_HandOffHandler(records)]
    root.setLevel(level.upper())


@atexit.register
def stop_logging() -> None:
    """Write what is still queued and stop the writer thread (at exit, or before a new
    set-up). Later lines (another exit hook's) are written at once, by the caller."""
    global _listener
    if _listener is None:
        return
    _listener.stop()
    _listener = None
    logging.getLogger().handlers = [_writer] if _writer is not None else []
