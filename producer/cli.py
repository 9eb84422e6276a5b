"""The ``edgeq`` command.

Producer commands (``chat``) need only this package. Worker commands (``worker``,
``make-tiny-model``) are imported from the ``worker`` package when they run, so a service that
installs plain ``edgeq`` never loads vLLM or torch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from producer.client import ChatClient, InvalidRequest
from producer.errors import EdgeqError, JobFailed, RedisUnavailable
from producer.protocol import DeltaEvent, DoneEvent, ErrorEvent
from producer.settings import ConfigError, ConnectionSettings, load_settings

# sysexits.h: systemd units and scripts can tell "fix the config" from "try again later".
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_CONFIG = 78


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


async def _chat(args: argparse.Namespace) -> int:
    overrides = {
        key: value
        for key, value in (
            ("redis_url", args.redis_url),
            ("queue", args.queue),
            ("stream_timeout_s", args.timeout),
        )
        if value is not None
    }
    settings = load_settings(ConnectionSettings, **overrides)
    fields = _chat_fields(args)
    async with ChatClient(settings) as client:
        job = await client.submit(fields.pop("messages"), **fields)  # type: ignore[arg-type]
        if args.json:
            print((await job.result()).model_dump_json(exclude_none=True))
            return EXIT_OK
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


def run_chat_command(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_chat(args))
    except ConfigError as error:
        _print_error("chat", error)
        return EXIT_CONFIG
    except InvalidRequest as error:
        _print_error("chat", f"invalid request: {error}")
        return EXIT_USAGE
    except RedisUnavailable as error:
        _print_error("chat", error)
        return EXIT_UNAVAILABLE
    except EdgeqError as error:
        _print_error("chat", error)
        return EXIT_JOB_FAILED
    except KeyboardInterrupt:
        return 130


# --- worker-side commands --------------------------------------------------------------------


def run_worker_command(args: argparse.Namespace) -> int:
    from worker.cli import run_worker_command as run

    return run(env_file=args.env_file)


def run_make_tiny_model_command(args: argparse.Namespace) -> int:
    from worker.cli import run_make_tiny_model_command as run

    return run(directory=args.directory, seed=args.seed)


# --- the parser ------------------------------------------------------------------------------


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
    chat.add_argument("--redis-url", help="overrides EDGEQ_REDIS_URL")
    chat.add_argument("--queue", help="overrides EDGEQ_QUEUE")
    chat.add_argument("--timeout", type=float, help="overrides EDGEQ_STREAM_TIMEOUT_S")
    chat.set_defaults(handler=run_chat_command)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
