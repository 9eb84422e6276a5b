"""The ``edgeq`` command: a registry of subcommands.

Each package registers its own subcommands (a ``register(commands)`` function in its
``commands`` module) and imports what a command needs only when that command runs, so
``edgeq chat`` on a service that installed plain ``edgeq`` never loads vLLM, torch, FastAPI
or matplotlib. A command line that names a command imports only the module that registers it,
so ``edgeq chat`` does not load the worker's modules either (only ``edgeq --help`` and a name
nobody registers load them all). Nothing here knows any command's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from edgeq import __version__

#: Each command module and the commands its ``register`` adds, in the order ``edgeq --help``
#: lists them. tests/test_layout.py checks the names against what each module registers.
COMMANDS: dict[str, tuple[str, ...]] = {
    "edgeq.producer.commands": ("chat", "watch", "cancel", "status"),
    "edgeq.producer.adapter_commands": ("adapters",),
    "edgeq.producer.dead_letter_commands": ("dead-letter",),
    "edgeq.producer.usage_commands": ("usage",),
    "edgeq.producer.tenant_commands": ("tenants",),
    "edgeq.gateway.commands": ("gateway",),
    "edgeq.resources.batches.commands": ("batch",),
    "edgeq.worker.commands": ("worker",),
    "edgeq.testing.commands": ("make-tiny-model", "chaos"),
    "edgeq.deploy.commands": ("bundle",),
    "edgeq.bench.commands": ("bench", "tune", "capacity", "simulate-box"),
}
COMMAND_MODULES = tuple(COMMANDS)


def module_of(argv: Sequence[str]) -> str | None:
    """The module that registers the command ``argv`` names, or None (no command, ``--help``,
    a name nobody registers). The options before the command take no value, so the command is
    the first argument that is not an option."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return next((module for module, names in COMMANDS.items() if command in names), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``edgeq`` parser; given the command line it will parse, with only the command
    module of the command it names (all of them when it names none)."""
    parser = argparse.ArgumentParser(
        prog="edgeq",
        description="Chat jobs through Redis to one warm vLLM engine, streamed back over pub/sub.",
        epilog="Settings come from EDGEQ_* environment variables and .env (see .env.example).",
    )
    parser.add_argument("--version", action="version", version=f"edgeq {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    only = None if argv is None else module_of(argv)
    for name in COMMAND_MODULES:
        if only is None or name == only:
            importlib.import_module(name).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
