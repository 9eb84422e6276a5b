"""The worker's and the gateway's log lines (edgeq.core.logs): one JSON object per line, our
events and other libraries' records alike, filtered by the configured level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from edgeq.core.logs import configure_logging


@pytest.fixture
def logged(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    """What the loggers write, configured at the level the test names."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging(request.param, stream)
    try:
        yield stream
    finally:
        structlog.reset_defaults()
        root.handlers, root.level = handlers, level


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize("logged", ["info"], indirect=True)
def test_our_events_and_library_records_are_json_lines_with_the_job_id(
    logged: io.StringIO,
) -> None:
    log = structlog.get_logger("edgeq.job")
    with structlog.contextvars.bound_contextvars(job_id="j1"):
        log.info("job_started", prompt_tokens=12)
        log.debug("not_shown")
        logging.getLogger("arq.worker").info("job %s started", "j1")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("job_error")
    ours, arq, failed = lines(logged)
    assert ours["event"] == "job_started" and ours["prompt_tokens"] == 12
    assert (ours["logger"], ours["level"], ours["job_id"]) == ("edgeq.job", "info", "j1")
    assert "timestamp" in ours
    assert (arq["event"], arq["logger"], arq["job_id"]) == ("job j1 started", "arq.worker", "j1")
    assert failed["level"] == "error" and "ValueError: boom" in str(failed["exception"])


@pytest.mark.parametrize("logged", ["warning"], indirect=True)
def test_the_level_filters_our_events_and_library_records_alike(logged: io.StringIO) -> None:
    structlog.get_logger("edgeq.job").info("job_started")
    logging.getLogger("arq.worker").info("hidden")
    structlog.get_logger("edgeq.job").warning("job_abandoned")
    [shown] = lines(logged)
    assert shown["event"] == "job_abandoned" and shown["level"] == "warning"
