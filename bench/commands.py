"""``edgeq bench``, ``edgeq tune``, ``edgeq capacity`` and ``edgeq simulate-box``: their
options, and the code behind them imported only when one runs (tokenizer, numpy, matplotlib,
maybe vLLM)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ON_OFF = {"on": True, "off": False, "true": True, "false": False}


def _parse_list(text: str, kind: Callable[[str], T], what: str) -> list[T]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def parse_int_list(text: str) -> list[int]:
    """``"16,32,64"`` → ``[16, 32, 64]`` (argparse type)."""
    return _parse_list(text, int, "integers")


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


def parse_float_list(text: str) -> list[float]:
    """``"20,50"`` → ``[20.0, 50.0]`` (argparse type)."""
    return _parse_list(text, float, "numbers")


def run_capacity_command(args: argparse.Namespace) -> int:
    if args.redis_ceiling:
        from edgeq.bench.redis_ceiling import run_redis_ceiling_command

        return run_redis_ceiling_command(args)
    from edgeq.bench.capacity import run_capacity_command as run

    return run(args)


def run_simulated_box_command(args: argparse.Namespace) -> int:
    from edgeq.worker.commands import run_worker_command

    def simulated_engine() -> Any:
        from edgeq.bench.simulate import GpuRate, SimulatedEngine

        gpu = GpuRate(step_ms=args.step_ms, prefill_ms=args.prefill_ms)
        if args.vllm_output:
            from edgeq.bench.vllm_output import ProcessedEngine

            return partial(ProcessedEngine.start, gpu=gpu)
        return partial(SimulatedEngine.start, gpu=gpu)

    return run_worker_command(env_file=args.env_file, engine_starter=simulated_engine)


def _gpu_rate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--step-ms",
        type=float,
        default=30.0,
        help="one decode step for every running chat (default: 30, Qwen3-0.6B on one GPU)",
    )
    parser.add_argument(
        "--prefill-ms", type=float, default=30.0, help="chat taken → first token (default: 30)"
    )


def _vllm_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-output",
        action="store_true",
        help="simulate only vLLM's engine core: the worker runs AsyncLLM's real output "
        "processing (detokenizing, RequestOutputs) on the model's tokenizer (EDGEQ_MODEL)",
    )


def _register_capacity(commands: argparse._SubParsersAction) -> None:
    capacity = commands.add_parser(
        "capacity",
        help="what one Redis carries: simulated GPU boxes streaming to real subscribers",
    )
    capacity.add_argument(
        "--boxes", type=parse_int_list, default=[1, 2, 4], metavar="N,N", help="(default: 1,2,4)"
    )
    capacity.add_argument(
        "--streams", type=int, default=256, help="chats in flight per box (default: 256)"
    )
    capacity.add_argument(
        "--interval-ms",
        type=parse_float_list,
        default=[20.0],
        metavar="MS,MS",
        help="EDGEQ_STREAM_INTERVAL_MS of the boxes (default: 20)",
    )
    _gpu_rate_options(capacity)
    capacity.add_argument(
        "--max-tokens", type=int, default=256, help="tokens per chat (default: 256)"
    )
    capacity.add_argument(
        "--warmup-s", type=float, default=10.0, help="before the window (default: 10)"
    )
    capacity.add_argument(
        "--window-s", type=float, default=20.0, help="measured window (default: 20)"
    )
    capacity.add_argument("--rounds", type=int, default=1, help="alternating rounds (default: 1)")
    _vllm_output_option(capacity)
    capacity.add_argument(
        "--model",
        type=Path,
        help="with --vllm-output: the model whose tokenizer the boxes detokenize with "
        "(default: the generated tiny model)",
    )
    capacity.add_argument("--out", type=Path, help="write every round's figures here (JSON)")
    capacity.add_argument("--logs", type=Path, help="keep the boxes' logs here")
    capacity.add_argument(
        "--redis-ceiling",
        action="store_true",
        help="no boxes: drive the publish script from C (redis-benchmark) to find what one "
        "Redis core takes",
    )
    capacity.add_argument(
        "--events",
        type=int,
        default=400_000,
        help="with --redis-ceiling: events per mode and round (default: 400000)",
    )
    capacity.set_defaults(handler=run_capacity_command)

    box = commands.add_parser(
        "simulate-box",
        help="the worker around a stand-in engine at a GPU's token rate (for `edgeq capacity`)",
    )
    box.add_argument("--env-file", type=Path, help="read settings from this file too")
    _gpu_rate_options(box)
    _vllm_output_option(box)
    box.set_defaults(handler=run_simulated_box_command)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bench``, ``tune``, ``capacity`` and ``simulate-box`` to the ``edgeq`` parser."""
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
    bench.add_argument(
        "--openai",
        metavar="URL",
        action="append",
        help="an OpenAI-compatible server (repeat it for several: openai, openai-2, ...)",
    )
    bench.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A.env", "B.env"),
        help="queue mode on two workers started here, one per settings file",
    )
    bench.add_argument(
        "--simulate-gpu",
        action="store_true",
        help="the workers and the direct engine started here make tokens at a GPU's rate "
        "instead of running the model (the queue's cost when the engine leaves the cores free)",
    )
    _gpu_rate_options(bench)
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
    _register_capacity(commands)
