"""``edgeq bench`` and ``edgeq tune``: their options, and the code behind them imported only
when one runs (tokenizer, numpy, matplotlib, maybe vLLM)."""

from __future__ import annotations

import argparse
from pathlib import Path

ON_OFF = {"on": True, "off": False, "true": True, "false": False}


def parse_int_list(text: str) -> list[int]:
    """``"16,32,64"`` → ``[16, 32, 64]`` (argparse type)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def parse_on_off_list(text: str) -> list[bool]:
    """``"on,off"`` → ``[True, False]`` (argparse type)."""
    values = []
    for part in (part.strip().lower() for part in text.split(",")):
        if part not in ON_OFF:
            raise argparse.ArgumentTypeError(f"expected on and/or off, comma-separated: {text!r}")
        values.append(ON_OFF[part])
    return values


def _workload_options(parser: argparse.ArgumentParser) -> None:
    """The seed's load-test workload, shared by `bench` and `tune`."""
    parser.add_argument("--users", type=int, default=50, help="concurrent users (default: 50)")
    per_user = parser.add_mutually_exclusive_group()
    per_user.add_argument(
        "--requests-per-user", type=int, default=1, help="sent one after another (default: 1)"
    )
    per_user.add_argument("--num-prompts", type=int, help="requests in all, dealt to the users")
    parser.add_argument("--input-len-min", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--input-len-max", type=int, default=256, help="(default: 256)")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer cap (default: 256)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--temperature", type=float, default=0.5, help="(default: 0.5)")
    parser.add_argument("--top-p", type=float, default=0.9, help="(default: 0.9)")


def run_bench_command(args: argparse.Namespace) -> int:
    from edgeq.bench.cli import run_bench_command as run

    return run(args)


def run_tune_command(args: argparse.Namespace) -> int:
    from edgeq.bench.tune import run_tune_command as run

    return run(args)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and ``tune`` to the ``edgeq`` parser."""
    # Defaults are the seed article's workload (50 users, prompts of 64-256 tokens, 256-token
    # answers) with edgeq's own sampling defaults, sent alike to every mode.
    bench = commands.add_parser(
        "bench",
        help="load-test: a seeded chat workload through the queue, the engine or an OpenAI server",
    )
    _workload_options(bench)
    bench.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:3000"
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every mode this many times, alternating, and report median [min-max]",
    )
    bench.add_argument("--out", type=Path, help="write the JSON report here")
    bench.add_argument("--plot", type=Path, help="write latency CDFs and a histogram (PNG)")
    bench.add_argument("--model", help="tokenizer and engine model (default: EDGEQ_MODEL)")
    bench.add_argument(
        "--queue", action="store_true", help="the worker serving EDGEQ_QUEUE (default mode)"
    )
    bench.add_argument(
        "--start-worker", action="store_true", help="queue mode on a Redis + worker started here"
    )
    bench.add_argument("--direct", action="store_true", help="an engine in this process")
    bench.add_argument("--openai", metavar="URL", help="an OpenAI-compatible server")
    bench.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A.env", "B.env"),
        help="queue mode on two workers started here, one per settings file",
    )
    bench.set_defaults(handler=run_bench_command)

    # tune sweeps the batch knobs with bench's workload, a worker per configuration, and
    # writes the best as an env file.
    tune = commands.add_parser(
        "tune", help="sweep max_num_seqs x budget x chunked prefill on this box, keep the best"
    )
    tune.add_argument(
        "--max-num-seqs",
        type=parse_int_list,
        default=[16, 32, 64],
        metavar="N,N",
        help="(default: 16,32,64)",
    )
    tune.add_argument(
        "--max-num-batched-tokens",
        type=parse_int_list,
        default=[512, 2048],
        metavar="N,N",
        help="step token budgets (default: 512,2048)",
    )
    tune.add_argument(
        "--chunked-prefill",
        type=parse_on_off_list,
        default=[True, False],
        metavar="on,off",
        help="(default: on,off)",
    )
    tune.add_argument(
        "--block-size",
        type=parse_int_list,
        metavar="N,N",
        help="KV block sizes (default: the platform's; CPU: multiples of 32)",
    )
    tune.add_argument(
        "--slo", nargs="+", metavar="NAME:MS", help="goodput SLOs (default: ttft:500 e2el:3000)"
    )
    _workload_options(tune)
    tune.add_argument("--model", help="tokenizer and engine model (default: EDGEQ_MODEL)")
    tune.add_argument("--out", type=Path, help="write the best configuration here (EDGEQ_* lines)")
    tune.add_argument("--plot", type=Path, help="goodput and tok/s per configuration (PNG)")
    tune.set_defaults(handler=run_tune_command)
