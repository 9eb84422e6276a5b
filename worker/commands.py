"""``edgeq worker``: run one warm engine serving the queue.

vLLM is imported only once the settings are valid, so a bad setting is reported in well under
a second and a box without the engine says which extra to install.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from edgeq.core.connection import redis_errors
from edgeq.core.errors import ConfigError, RedisUnavailable
from edgeq.core.logs import configure_logging
from edgeq.core.settings import load_settings
from edgeq.exit_codes import EXIT_CONFIG, EXIT_JOB_FAILED, EXIT_UNAVAILABLE
from edgeq.worker.settings import WorkerSettings

if TYPE_CHECKING:  # the app module imports vLLM
    from edgeq.worker.app import EngineStarter


def run_worker_command(
    *, env_file: Path | None, engine_starter: Callable[[], EngineStarter] | None = None
) -> int:
    """``edgeq worker``; ``engine_starter`` gives another engine than vLLM's, once the
    settings are valid (``edgeq simulate-box``)."""
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
        from edgeq.worker.app import run_worker  # imports vLLM: tens of seconds on a small box
    except ImportError as error:
        print(
            f"edgeq worker: the engine is not installed ({error}); "
            "install edgeq[gpu] on a GPU box or edgeq[cpu] elsewhere",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        # Redis is first used before the engine starts (arq reads its INFO): an unreachable
        # one, or a certificate that does not verify, ends the start at once with 69.
        with redis_errors(settings.redis_url):
            if engine_starter is None:
                return run_worker(settings, process_started=process_started)
            return run_worker(
                settings, process_started=process_started, engine_starter=engine_starter()
            )
    except ConfigError as error:
        print(f"edgeq worker: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except RedisUnavailable as error:
        log.error("worker_failed", error=str(error))
        print(f"edgeq worker: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except Exception as error:
        log.exception("worker_failed", error=f"{type(error).__name__}: {error}")
        print(f"edgeq worker: stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_JOB_FAILED


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``worker`` to the ``edgeq`` parser."""
    worker = commands.add_parser(
        "worker", help="run the worker: one warm engine serving the queue (needs edgeq[gpu|cpu])"
    )
    worker.add_argument("--env-file", type=Path, help="read settings from this file too")
    worker.set_defaults(handler=lambda args: run_worker_command(env_file=args.env_file))
