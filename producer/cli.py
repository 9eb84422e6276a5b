"""The ``edgeq`` command.

Producer commands (``chat``) need only this package. Worker commands (``worker``,
``make-tiny-model``) are imported from the ``worker`` package when they run, so a service that
installs plain ``edgeq`` never loads vLLM or torch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from producer.client import ChatClient, ChatJob, InvalidRequest, redis_errors
from producer.errors import EdgeqError, JobFailed, QueueFull, RedisUnavailable
from producer.protocol import DeltaEvent, DoneEvent, ErrorEvent
from producer.settings import ConfigError, ConnectionSettings, load_settings
from producer.status import read_status, render_status

# sysexits.h: systemd units and scripts can tell "fix the config" from "try again later".
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_CONFIG = 78
EXIT_INTERRUPTED = 130


def _print_error(command: str, message: object) -> None:
    print(f"edgeq {command}: {message}", file=sys.stderr)


# --- edgeq chat ------------------------------------------------------------------------------


def _chat_fields(args: argparse.Namespace) -> dict[str, object]:
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    fields: dict[str, object] = {"messages": messages, "return_reasoning": args.reasoning}
    for name in ("temperature", "top_p", "max_tokens", "stop", "seed", "enable_thinking"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    return fields


def _connection_settings(args: argparse.Namespace) -> ConnectionSettings:
    overrides = {
        key: value
        for key, value in (
            ("redis_url", args.redis_url),
            ("queue", args.queue),
            ("stream_timeout_s", getattr(args, "timeout", None)),
        )
        if value is not None
    }
    return load_settings(ConnectionSettings, **overrides)


async def _print_stream(job: ChatJob) -> int:
    """Write deltas to stdout as they come; an error event becomes JobFailed."""
    async for event in job.stream():
        if isinstance(event, DeltaEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, DoneEvent):
            sys.stdout.write("\n")
            if event.reasoning:
                print(f"[reasoning]\n{event.reasoning}", file=sys.stderr)
        elif isinstance(event, ErrorEvent):
            sys.stdout.write("\n")
            raise JobFailed(job.job_id, event.code, event.message)
    return EXIT_OK


async def _chat(args: argparse.Namespace) -> int:
    fields = _chat_fields(args)
    async with ChatClient(_connection_settings(args)) as client:
        job = await client.submit(fields.pop("messages"), **fields)  # type: ignore[arg-type]
        if args.json:
            print((await job.result()).model_dump_json(exclude_none=True))
            return EXIT_OK
        return await _print_stream(job)


async def _watch(args: argparse.Namespace) -> int:
    async with ChatClient(_connection_settings(args)) as client:
        job = await client.attach(args.job_id, after_seq=args.after_seq)
        return await _print_stream(job)


async def _cancel(args: argparse.Namespace) -> int:
    async with ChatClient(_connection_settings(args)) as client:
        if await client.cancel(args.job_id, "cancelled with edgeq cancel"):
            print(f"job {args.job_id} cancelled")
            return EXIT_OK
    _print_error("cancel", f"job {args.job_id} had already ended (or never existed)")
    return EXIT_JOB_FAILED


async def _status(args: argparse.Namespace) -> int:
    async with ChatClient(_connection_settings(args)) as client:
        with redis_errors(client.settings.redis_url):
            status = await read_status(client.redis, client.settings)
    print(status.model_dump_json(indent=2) if args.json else render_status(status))
    return EXIT_OK


def _run_producer_command(name: str, command: Callable[[argparse.Namespace], Awaitable[int]]):
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(command(args))
        except ConfigError as error:
            _print_error(name, error)
            return EXIT_CONFIG
        except InvalidRequest as error:
            _print_error(name, f"invalid request: {error}")
            return EXIT_USAGE
        except (RedisUnavailable, QueueFull) as error:
            _print_error(name, error)
            return EXIT_UNAVAILABLE
        except EdgeqError as error:
            _print_error(name, error)
            return EXIT_JOB_FAILED
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    return run


run_chat_command = _run_producer_command("chat", _chat)
run_watch_command = _run_producer_command("watch", _watch)
run_cancel_command = _run_producer_command("cancel", _cancel)
run_status_command = _run_producer_command("status", _status)


def run_gateway_command(args: argparse.Namespace) -> int:
    try:
        from gateway.cli import run_gateway_command as run
    except ImportError as error:
        _print_error("gateway", f"the gateway is not installed ({error}); install edgeq[gateway]")
        return EXIT_CONFIG
    return run(env_file=args.env_file)


# --- worker-side commands --------------------------------------------------------------------


def run_worker_command(args: argparse.Namespace) -> int:
    from worker.cli import run_worker_command as run

    return run(env_file=args.env_file)


def run_make_tiny_model_command(args: argparse.Namespace) -> int:
    from worker.cli import run_make_tiny_model_command as run

    return run(directory=args.directory, seed=args.seed)


# --- the parser ------------------------------------------------------------------------------


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


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="overrides EDGEQ_REDIS_URL")
    parser.add_argument("--queue", help="overrides EDGEQ_QUEUE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeq",
        description="Chat jobs through Redis to one warm vLLM engine, streamed back over pub/sub.",
        epilog="Settings come from EDGEQ_* environment variables and .env (see .env.example).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    chat = commands.add_parser("chat", help="send one chat and stream the answer to stdout")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--system", help="a system message sent before the prompt")
    chat.add_argument("--temperature", type=float, help="0 to 2 (default: the worker's)")
    chat.add_argument("--top-p", dest="top_p", type=float, help="in (0, 1]")
    chat.add_argument("--max-tokens", dest="max_tokens", type=int, help="at least 1")
    chat.add_argument("--stop", action="append", help="a stop string (repeatable)")
    chat.add_argument("--seed", type=int, help="sampling seed, for repeatable answers")
    chat.add_argument(
        "--think",
        dest="enable_thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turn the model's thinking on or off (default: the worker's, off)",
    )
    chat.add_argument(
        "--reasoning", action="store_true", help="print the reasoning (with --think) to stderr"
    )
    chat.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _connection_options(chat)
    chat.add_argument("--timeout", type=float, help="overrides EDGEQ_STREAM_TIMEOUT_S")
    chat.set_defaults(handler=run_chat_command)

    watch = commands.add_parser(
        "watch", help="replay a job's stream from its buffer, then follow it live"
    )
    watch.add_argument("job_id")
    watch.add_argument("--after-seq", type=int, default=-1, help="skip events up to this seq")
    _connection_options(watch)
    watch.add_argument("--timeout", type=float, help="overrides EDGEQ_STREAM_TIMEOUT_S")
    watch.set_defaults(handler=run_watch_command)

    cancel = commands.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")
    _connection_options(cancel)
    cancel.set_defaults(handler=run_cancel_command)

    status = commands.add_parser(
        "status", help="queue depth, live workers and recent outcomes, read from Redis"
    )
    status.add_argument("--json", action="store_true", help="print it as JSON, for scripts")
    _connection_options(status)
    status.set_defaults(handler=run_status_command)

    gateway = commands.add_parser(
        "gateway", help="serve an OpenAI-compatible HTTP API in front of the queue"
    )
    gateway.add_argument("--env-file", type=Path, help="read settings from this file too")
    gateway.set_defaults(handler=run_gateway_command)

    worker = commands.add_parser(
        "worker", help="run the worker: one warm engine serving the queue (needs edgeq[gpu|cpu])"
    )
    worker.add_argument("--env-file", type=Path, help="read settings from this file too")
    worker.set_defaults(handler=run_worker_command)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a tiny random-weight Qwen3-architecture model (for tests)"
    )
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=run_make_tiny_model_command)

    # edgeq bundle: the offline installer for a box (worker/bundle.py), imported only when it runs.
    def run_bundle_command(args: argparse.Namespace) -> int:
        from worker.bundle import run_bundle_command as run

        return run(
            variant=args.variant, out_dir=args.out, model_dir=args.model_dir,
            model_id=args.model, revision=args.revision, model_name=args.model_name,
            version_suffix=args.version_suffix, wheelhouse_from=args.wheelhouse_from,
            python_version=args.python_version, platform=args.platform, keep_dir=args.keep_dir,
        )  # fmt: skip

    bundle = commands.add_parser(
        "bundle", help="build one offline .tar (wheels, model, units, install.sh) for a box"
    )
    bundle.add_argument("--variant", choices=["gpu", "cpu"], required=True)
    source = bundle.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=Path, help="a local model directory")
    source.add_argument("--model", help="a Hugging Face id, downloaded once (needs --revision)")
    bundle.add_argument("--revision", help="the model's pinned revision (a commit sha)")
    bundle.add_argument("--model-name", help="directory name on the box (default: from the model)")
    bundle.add_argument("--out", type=Path, default=Path("dist"), help="(default: ./dist)")
    bundle.add_argument(
        "--version-suffix", default="", help="append +SUFFIX to edgeq's version (a rebuild)"
    )
    bundle.add_argument(
        "--wheelhouse-from", type=Path, help="reuse the wheels in DIR instead of downloading them"
    )
    bundle.add_argument("--python-version", help="the box's Python, e.g. 3.11 (default: this one)")
    bundle.add_argument("--platform", help="the box's wheel platform, e.g. manylinux_2_28_x86_64")
    bundle.add_argument("--keep-dir", action="store_true", help="also keep the unpacked bundle")
    bundle.set_defaults(handler=run_bundle_command)

    # edgeq bench: the code is in bench/ (tokenizer, matplotlib, maybe vLLM), imported only when
    # it runs. Defaults are the seed article's workload (50 users, prompts of 64-256 tokens,
    # 256-token answers) with edgeq's own sampling defaults, sent alike to every mode.
    def run_bench_command(args: argparse.Namespace) -> int:
        from bench.cli import run_bench_command as run

        return run(args)

    bench = commands.add_parser(
        "bench",
        help="load-test: a seeded chat workload through the queue, the engine or an OpenAI server",
    )
    _workload_options(bench)
    bench.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:3000"
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

    # edgeq tune: sweeps the batch knobs with bench's workload, a worker per configuration
    # (bench/tune.py, imported only when it runs), and writes the best as an env file.
    def run_tune_command(args: argparse.Namespace) -> int:
        from bench.tune import run_tune_command as run

        return run(args)

    def int_list(text: str) -> list[int]:
        from bench.tune import parse_int_list

        return parse_int_list(text)

    def on_off_list(text: str) -> list[bool]:
        from bench.tune import parse_on_off_list

        return parse_on_off_list(text)

    tune = commands.add_parser(
        "tune", help="sweep max_num_seqs x budget x chunked prefill on this box, keep the best"
    )
    tune.add_argument(
        "--max-num-seqs",
        type=int_list,
        default=[16, 32, 64],
        metavar="N,N",
        help="(default: 16,32,64)",
    )
    tune.add_argument(
        "--max-num-batched-tokens",
        type=int_list,
        default=[512, 2048],
        metavar="N,N",
        help="step token budgets (default: 512,2048)",
    )
    tune.add_argument(
        "--chunked-prefill",
        type=on_off_list,
        default=[True, False],
        metavar="on,off",
        help="(default: on,off)",
    )
    tune.add_argument(
        "--block-size",
        type=int_list,
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
