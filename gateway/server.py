"""Serving the OpenAI-compatible API with uvicorn until SIGTERM (``edgeq gateway``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog
import uvicorn
from fastapi import FastAPI

from edgeq.core.errors import ConfigError
from edgeq.core.logs import configure_logging
from edgeq.core.settings import load_settings, redacted_url
from edgeq.exit_codes import EXIT_CONFIG, EXIT_OK, EXIT_UNAVAILABLE
from edgeq.gateway.app import create_app
from edgeq.gateway.settings import GatewaySettings

SHUTDOWN_MARGIN_S = 2.0
#: How ``--workers N`` hands the parent's settings to its N processes (uvicorn starts them
#: fresh from an import string, so they cannot be given the object itself).
SETTINGS_ENV = "EDGEQ_GATEWAY_SETTINGS_JSON"


def app_from_parent() -> FastAPI:
    """The app of one of ``--workers N`` processes: the parent's settings, exactly."""
    settings = GatewaySettings.model_validate_json(os.environ[SETTINGS_ENV])
    configure_logging(settings.log_level)
    return create_app(settings)


def run_gateway(
    *,
    env_file: Path | None,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
) -> int:
    """``host``, ``port`` and ``workers`` (the command's options) win over the settings."""
    overrides = {
        name: value
        for name, value in (
            ("gateway_host", host),
            ("gateway_port", port),
            ("gateway_workers", workers),
        )
        if value is not None
    }
    try:
        settings = load_settings(GatewaySettings, env_file=env_file, **overrides)
    except ConfigError as error:
        print(f"edgeq gateway: {error}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level)
    _log_start(settings)
    if settings.gateway_workers > 1:
        return _run_processes(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            host=settings.gateway_host,
            port=settings.gateway_port,
            log_config=None,  # uvicorn's records go through our JSON handler
            access_log=False,  # the gateway logs one structured event per request instead
            # Streams get EDGEQ_GATEWAY_SHUTDOWN_TIMEOUT_S (sse-starlette's grace period);
            # uvicorn waits a little longer, so it never cuts one short first.
            timeout_graceful_shutdown=settings.gateway_shutdown_timeout_s + SHUTDOWN_MARGIN_S,
            lifespan="on",
        )
    )
    try:
        server.run()
    except SystemExit:  # uvicorn's way of saying it could not start (it logged why)
        if server.started:
            raise
    if not server.started:
        print(
            f"edgeq gateway: could not start on {settings.gateway_host}:{settings.gateway_port} "
            f"(see the log above; EDGEQ_GATEWAY_HOST, EDGEQ_GATEWAY_PORT)",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    return EXIT_OK


def _log_start(settings: GatewaySettings) -> None:
    structlog.get_logger("edgeq.gateway").info(
        "gateway_starting",
        listen=f"{settings.gateway_host}:{settings.gateway_port}",
        redis=redacted_url(settings.redis_url),
        queue=settings.queue,
        auth="bearer" if settings.auth_required else "off",
        tenant_keys=len(settings.gateway_tenant_keys),
        # Names, not keys: what EDGEQ_KEY_RPM and the usage ledger know each key by.
        key_names=sorted({job_key.name for job_key in settings.job_keys}),
        workers=settings.gateway_workers,
    )


def _run_processes(settings: GatewaySettings) -> int:
    """``--workers N``: uvicorn's supervisor and N processes on one socket. The gateway keeps
    no state of its own (everything is in Redis), so any process serves any request."""
    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    uvicorn.run(
        "edgeq.gateway.server:app_from_parent",
        factory=True,
        host=settings.gateway_host,
        port=settings.gateway_port,
        workers=settings.gateway_workers,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.gateway_shutdown_timeout_s + SHUTDOWN_MARGIN_S,
        lifespan="on",
    )
    return EXIT_OK
