"""The ``edgeq`` command: a registry of subcommands.

Each package registers its own subcommands (a ``register(commands)`` function in its
``commands`` module) and imports what a command needs only when that command runs, so
``edgeq chat`` on a service that installed plain ``edgeq`` never loads vLLM, torch, FastAPI
or matplotlib. Nothing here knows any command's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from edgeq import __version__

#: In the order ``edgeq --help`` lists them.
COMMAND_MODULES = (
    "edgeq.producer.commands",  # chat, watch, cancel, status
    "edgeq.gateway.commands",  # gateway
    "edgeq.worker.commands",  # worker
    "edgeq.testing.commands",  # make-tiny-model
    "edgeq.deploy.commands",  # bundle
    "edgeq.bench.commands",  # bench, tune, capacity, simulate-box
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeq",
        description="Chat jobs through Redis to one warm vLLM engine, streamed back over pub/sub.",
        epilog="Settings come from EDGEQ_* environment variables and .env (see .env.example).",
    )
    parser.add_argument("--version", action="version", version=f"edgeq {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
