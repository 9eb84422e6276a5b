"""``edgeq gateway``: the OpenAI-compatible HTTP front. FastAPI and uvicorn (the
``edgeq[gateway]`` extra) are imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgeq.exit_codes import EXIT_CONFIG


def run_gateway_command(args: argparse.Namespace) -> int:
    try:
        from edgeq.gateway.server import run_gateway
    except ImportError as error:
        print(
            f"edgeq gateway: the gateway is not installed ({error}); install edgeq[gateway]",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    return run_gateway(env_file=args.env_file, host=args.host, port=args.port, workers=args.workers)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``gateway`` to the ``edgeq`` parser."""
    gateway = commands.add_parser(
        "gateway", help="serve an OpenAI-compatible HTTP API in front of the queue"
    )
    gateway.add_argument("--env-file", type=Path, help="read settings from this file too")
    gateway.add_argument("--host", help="address to listen on (overrides EDGEQ_GATEWAY_HOST)")
    gateway.add_argument(
        "--port", type=int, help="port to listen on (overrides EDGEQ_GATEWAY_PORT)"
    )
    gateway.add_argument(
        "--workers",
        type=int,
        help="gateway processes serving the port (overrides EDGEQ_GATEWAY_WORKERS)",
    )
    gateway.set_defaults(handler=run_gateway_command)
