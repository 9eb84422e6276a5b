"""Worker-side commands of ``edgeq``; the parser lives in ``producer.cli``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import structlog

from producer.cli import EXIT_CONFIG, EXIT_JOB_FAILED, EXIT_OK
from producer.logs import configure_logging
from producer.settings import ConfigError, load_settings
from worker.settings import WorkerSettings


def run_worker_command(*, env_file: Path | None) -> int:
    process_started = time.monotonic()
    try:
        settings = load_settings(WorkerSettings, env_file=env_file)
    except ConfigError as error:
        # Before logging is configured on purpose: this must be readable by a person.
        print(f"edgeq worker: {error}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level)
    log = structlog.get_logger("edgeq.worker")
    try:
        from worker.app import run_worker  # imports vLLM: tens of seconds on a small box
    except ImportError as error:
        print(
            f"edgeq worker: the engine is not installed ({error}); "
            "install edgeq[gpu] on a GPU box or edgeq[cpu] elsewhere",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        run_worker(settings, process_started=process_started)
    except ConfigError as error:
        print(f"edgeq worker: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as error:
        log.exception("worker_failed", error=f"{type(error).__name__}: {error}")
        print(f"edgeq worker: stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_JOB_FAILED
    return EXIT_OK


def run_make_tiny_model_command(*, directory: Path, seed: int) -> int:
    from worker.tiny_model import make_tiny_model

    started = time.monotonic()
    info = make_tiny_model(directory, seed=seed)
    print(
        f"tiny model written to {info.directory}: vocab {info.vocab_size}, "
        f"{info.total_bytes / 1e6:.2f} MB in {len(info.files)} files, "
        f"{time.monotonic() - started:.2f} s"
    )
    return EXIT_OK
