"""The producer's subcommands of ``edgeq``: ``chat``, ``watch``, ``cancel`` and ``status``.

They need only the client and the core, so they work on a service that installed plain
``edgeq``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from edgeq.core.connection import redis_errors
from edgeq.core.errors import (
    ConfigError,
    EdgeqError,
    InvalidRequest,
    JobFailed,
    QueueFull,
    RedisUnavailable,
)
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent
from edgeq.core.settings import ConnectionSettings, load_settings
from edgeq.exit_codes import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from edgeq.producer.client import ChatClient, ChatJob
from edgeq.producer.status import read_status, render_status


def _print_error(command: str, message: object) -> None:
    print(f"edgeq {command}: {message}", file=sys.stderr)


# --- edgeq chat ------------------------------------------------------------------------------


def _json_file(option: str, path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise InvalidRequest(f"{option}: cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise InvalidRequest(f"{option}: {path} is not JSON: {error}") from None


def _tool_choice(value: str) -> object:
    if value in ("none", "auto", "required"):
        return value
    return {"type": "function", "function": {"name": value}}


def _chat_fields(args: argparse.Namespace) -> dict[str, object]:
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    fields: dict[str, object] = {"messages": messages, "return_reasoning": args.reasoning}
    names = ("temperature", "top_p", "max_tokens", "stop", "seed", "enable_thinking", "adapter")
    for name in names:
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.json_schema is not None:
        schema = _json_file("--json-schema", args.json_schema)
        name = re.sub(r"[^A-Za-z0-9_-]", "_", args.json_schema.stem)[:64] or "answer"
        spec = {"name": name, "schema": schema}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    if args.regex is not None:
        fields["constraint"] = {"regex": args.regex}
    if args.choice:
        fields["constraint"] = {"choice": args.choice}
    if args.tools is not None:
        fields["tools"] = _json_file("--tools", args.tools)
    if args.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(args.tool_choice)
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
            for call in event.tool_calls or ():  # one JSON object a line, after the text
                print(call.model_dump_json())
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


# --- the parser ------------------------------------------------------------------------------


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="overrides EDGEQ_REDIS_URL")
    parser.add_argument("--queue", help="overrides EDGEQ_QUEUE")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``chat``, ``watch``, ``cancel`` and ``status`` to the ``edgeq`` parser."""
    chat = commands.add_parser("chat", help="send one chat and stream the answer to stdout")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--system", help="a system message sent before the prompt")
    chat.add_argument("--temperature", type=float, help="0 to 2 (default: the worker's)")
    chat.add_argument("--top-p", dest="top_p", type=float, help="in (0, 1]")
    chat.add_argument("--max-tokens", dest="max_tokens", type=int, help="at least 1")
    chat.add_argument("--stop", action="append", help="a stop string (repeatable)")
    chat.add_argument("--seed", type=int, help="sampling seed, for repeatable answers")
    chat.add_argument("--adapter", help="answer with this LoRA adapter (edgeq adapters list)")
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
    shape = chat.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="answer with JSON valid under the JSON Schema in FILE",
    )
    shape.add_argument("--regex", help="answer with text that matches this regular expression")
    shape.add_argument(
        "--choice", action="append", help="answer with exactly one of these (repeatable)"
    )
    chat.add_argument(
        "--tools",
        type=Path,
        metavar="FILE",
        help="a JSON list of OpenAI function tools the model may call; calls print as JSON lines",
    )
    chat.add_argument(
        "--tool-choice",
        metavar="auto|required|none|NAME",
        help="whether the model must call a tool, or which one (default: auto)",
    )
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
