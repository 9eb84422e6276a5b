"""``edgeq make-tiny-model``: the model tests, the demo and bench run the real engine on."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from edgeq.exit_codes import EXIT_OK


def run_make_tiny_model_command(*, directory: Path, seed: int) -> int:
    from edgeq.testing.tiny_model import make_tiny_model  # numpy, tokenizers: when it runs

    started = time.monotonic()
    info = make_tiny_model(directory, seed=seed)
    print(
        f"tiny model written to {info.directory}: vocab {info.vocab_size}, "
        f"{info.total_bytes / 1e6:.2f} MB in {len(info.files)} files, "
        f"{time.monotonic() - started:.2f} s"
    )
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``make-tiny-model`` to the ``edgeq`` parser."""
    tiny = commands.add_parser(
        "make-tiny-model", help="write a tiny random-weight Qwen3-architecture model (for tests)"
    )
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(
        handler=lambda args: run_make_tiny_model_command(directory=args.directory, seed=args.seed)
    )
