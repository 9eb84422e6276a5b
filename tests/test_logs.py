"""The worker's and the gateway's logs (edgeq.core.logs), in a process of their own: JSON lines
on stderr, written off the caller's thread, none lost at exit."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import textwrap

# Logs a burst of events from a "job", a stdlib record with arguments (as arq's are), and an
# error with its traceback, then says so on stdout and exits without any explicit flush.
PROGRAM = textwrap.dedent(
    """
    import logging, sys, structlog
    from edgeq.core.logs import configure_logging
    configure_logging("info")
    log = structlog.get_logger("edgeq.worker.jobs")
    structlog.contextvars.bind_contextvars(job_id="job-1")
    for n in range(int(sys.argv[1])):
        log.info("job_started", n=n, padding="x" * 200)
    logging.getLogger("arq.worker").info("%d jobs %s", 3, "running")
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("job_error")
    structlog.contextvars.unbind_contextvars("job_id")
    logging.getLogger("arq.worker").debug("below the level")
    print("logged", flush=True)
    """
)


# Far more than the program needs to log when nothing holds it up (well under a second).
WAIT_S = 30


def run_logging(lines: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(lines)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_line_is_json_with_the_jobs_context_and_none_is_lost_at_exit() -> None:
    process = run_logging(50)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out == "logged\n"
    events = [json.loads(line) for line in err.splitlines()]

    started = [event for event in events if event["event"] == "job_started"]
    assert [event["n"] for event in started] == list(range(50))
    assert all(event["job_id"] == "job-1" and event["level"] == "info" for event in started)
    assert started[0]["timestamp"].endswith("Z")
    (foreign,) = [event for event in events if event["logger"] == "arq.worker"]
    # A stdlib record rendered on the writer thread keeps the caller's bound job id.
    assert foreign == {
        "event": "3 jobs running",
        "job_id": "job-1",
        "level": "info",
        "logger": "arq.worker",
        "timestamp": foreign["timestamp"],
    }
    (error,) = [event for event in events if event["event"] == "job_error"]
    assert error["level"] == "error" and error["job_id"] == "job-1"
    assert "ZeroDivisionError: division by zero" in error["exception"]
    assert not any(event["event"] == "below the level" for event in events)


def test_a_stderr_that_takes_nothing_does_not_hold_up_the_logging_code() -> None:
    """Nobody reads the process's stderr until it says it is done: 2,000 lines of ~300
    bytes fill the pipe (64 KiB) many times over. Written by the caller, the first full
    pipe would stop it; handed off, the caller goes on, and the lines wait for the reader."""
    lines = 2000
    process = run_logging(lines)
    assert process.stdout is not None and process.stderr is not None
    try:
        ready, _, _ = select.select([process.stdout], [], [], WAIT_S)
        assert ready, f"the program was still logging after {WAIT_S} s: held up by its stderr"
        assert process.stdout.readline() == "logged\n"
        err = process.stderr.read()  # now the writer thread can go on
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    started = [line for line in err.splitlines() if '"job_started"' in line]
    assert len(started) == lines


def test_configuring_again_writes_the_queued_lines_first() -> None:
    program = PROGRAM.replace(
        'print("logged", flush=True)',
        'configure_logging("info"); log.info("after_reconfigure"); print("logged", flush=True)',
    )
    process = subprocess.run(
        [sys.executable, "-c", program, "10"], capture_output=True, text=True, timeout=60
    )
    assert process.returncode == 0, process.stderr
    events = [json.loads(line)["event"] for line in process.stderr.splitlines()]
    assert events.count("job_started") == 10
    assert events[-1] == "after_reconfigure"
