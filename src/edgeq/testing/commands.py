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


def run_chaos(args: argparse.Namespace) -> int:
    from edgeq.testing.chaos import FAULT_KINDS, run_chaos_command  # the campaign: when it runs

    return run_chaos_command(
        duration_s=args.duration,
        seed=args.seed,
        workers=args.workers,
        in_flight=args.in_flight,
        model=args.model,
        gateway=args.gateway,
        out=args.out,
        workdir=args.workdir,
        lease_ttl_s=args.lease_ttl,
        outage_s=args.outage_limit,
        faults=args.faults or FAULT_KINDS,
    )


def fault_kinds(value: str) -> tuple[str, ...]:
    from edgeq.testing.chaos import ALL_FAULT_KINDS

    kinds = tuple(kind.strip() for kind in value.split(",") if kind.strip())
    unknown = sorted(set(kinds) - set(ALL_FAULT_KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown fault kinds {unknown}; choose from {', '.join(ALL_FAULT_KINDS)}"
        )
    return kinds


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``make-tiny-model`` and ``chaos`` to the ``edgeq`` parser."""
    tiny = commands.add_parser(
        "make-tiny-model", help="write a tiny random-weight Qwen3-architecture model (for tests)"
    )
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(
        handler=lambda args: run_make_tiny_model_command(directory=args.directory, seed=args.seed)
    )

    chaos = commands.add_parser(
        "chaos",
        help="a chaos campaign: mixed faults under steady load, every job checked (issue #34)",
        description=(
            "Start a private Redis (append-only), workers under a restarting supervisor and "
            "optionally the gateway; keep chats in flight while a seeded schedule of faults "
            "is injected; check every accepted job; print a report. Exit status 1 when a "
            "problem was found."
        ),
    )
    chaos.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    chaos.add_argument("--seed", type=int, default=1, help="the fault schedule and workload")
    chaos.add_argument("--workers", type=int, default=2)
    chaos.add_argument("--in-flight", type=int, default=8, help="chats kept in flight")
    chaos.add_argument(
        "--model", type=Path, default=None, help="model directory (default: a tiny model)"
    )
    chaos.add_argument("--gateway", action="store_true", help="also run and drive the gateway")
    chaos.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    chaos.add_argument(
        "--workdir", type=Path, default=None, help="logs and Redis data (default: a temp dir)"
    )
    chaos.add_argument("--lease-ttl", type=float, default=5.0, help="EDGEQ_LEASE_TTL_S")
    chaos.add_argument("--outage-limit", type=float, default=8.0, help="EDGEQ_REDIS_OUTAGE_S")
    chaos.add_argument(
        "--faults",
        type=fault_kinds,
        default=None,
        help=(
            "comma-separated fault kinds (default: all but freeze_engine and poison): "
            "kill_worker, stop_worker, restart_redis, redis_outage, kill_gateway (only with "
            "--gateway), slow_link, drop_link, freeze_engine (one worker's engine frozen until "
            "the worker ends itself), poison (a request that kills every engine it reaches: "
            "quarantined after two)"
        ),
    )
    chaos.set_defaults(handler=run_chaos)
