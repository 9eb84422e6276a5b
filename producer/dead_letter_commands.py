"""``edgeq dead-letter list | show ID | retry ID | drop ID``: the queue's quarantined (poison)
jobs (core/dead_letter.py, docs/dead-letter.md). Nothing of a prompt is printed unless
``--show-prompt`` asks for it: the messages are shown as their roles and lengths.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from redis.asyncio import Redis

from edgeq.core.connection import make_redis, redis_errors
from edgeq.core.dead_letter import (
    DeadLetter,
    drop_dead_letter,
    list_dead_letters,
    read_dead_letter,
)
from edgeq.core.errors import InvalidRequest
from edgeq.core.fingerprint import lift_refusal
from edgeq.core.protocol import ChatRequest
from edgeq.core.settings import ConnectionSettings
from edgeq.exit_codes import EXIT_OK
from edgeq.producer.commands import (
    _connection_options,
    _connection_settings,
    _run_producer_command,
)


def _without_prompt(request: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request with each message's text replaced by its length."""
    if request is None:
        return None
    messages = request.get("messages")
    if not isinstance(messages, list):
        return request
    shown = [
        {"role": m.get("role"), "content_chars": len(str(m.get("content", "")))}
        if isinstance(m, dict)
        else "?"
        for m in messages
    ]
    return {**request, "messages": shown}


def _shown(letter: DeadLetter, *, show_prompt: bool) -> dict[str, Any]:
    shown = letter.summary(with_request=True)
    if not show_prompt:
        shown["request"] = _without_prompt(letter.request)
    return shown


async def _entry(redis: Redis, settings: ConnectionSettings, job_id: str) -> DeadLetter:
    letter = await read_dead_letter(redis, settings.queue, job_id)
    if letter is None:
        raise InvalidRequest(
            f"job {job_id} is not in the dead-letter set of queue {settings.queue} (never "
            f"quarantined, dropped, or kept past EDGEQ_DEAD_LETTER_TTL_S)"
        )
    return letter


async def _list(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            letters = await list_dead_letters(redis, settings.queue,
                                              ttl_s=settings.dead_letter_ttl_s)  # fmt: skip
    finally:
        await redis.aclose(close_connection_pool=True)
    if args.json:
        rows = [
            _shown(letter, show_prompt=True) if args.show_prompt else letter.summary()
            for letter in letters
        ]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if not letters:
        print(f"dead-letter set of queue {settings.queue}: empty")
    for letter in letters:
        line = f"{letter.job_id}  {letter.when}  {letter.reason}  {letter.tenant}  {letter.model}"
        if args.show_prompt and letter.request is not None:
            line += f"  {json.dumps(letter.request.get('messages'), ensure_ascii=False)}"
        print(line)
    return EXIT_OK


async def _show(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            letter = await _entry(redis, settings, args.job_id)
    finally:
        await redis.aclose(close_connection_pool=True)
    print(json.dumps(_shown(letter, show_prompt=args.show_prompt), indent=2, ensure_ascii=False))
    return EXIT_OK


async def _retry(args: argparse.Namespace) -> int:
    # Imported here: only retry needs the client (and its subscriptions).
    from edgeq.producer.client import ChatClient

    settings = _connection_settings(args)
    async with ChatClient(settings) as client:
        with redis_errors(settings.redis_url):
            letter = await _entry(client.redis, settings, args.job_id)
        if letter.request is None:
            raise InvalidRequest(f"job {args.job_id}: its record holds no readable request")
        if letter.fingerprint is not None:  # else the door refuses the request sent here
            with redis_errors(settings.redis_url):
                await lift_refusal(client.redis, settings.queue, letter.fingerprint)
        job = await client.submit(ChatRequest.model_validate(letter.request))
        await job.aclose()  # the new job goes on; watch it with `edgeq watch`
        if not args.keep:
            with redis_errors(settings.redis_url):
                await drop_dead_letter(client.redis, settings.queue, args.job_id)
    print(job.job_id)
    return EXIT_OK


async def _drop(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            if not await drop_dead_letter(redis, settings.queue, args.job_id):
                await _entry(redis, settings, args.job_id)  # raises, naming why
    finally:
        await redis.aclose(close_connection_pool=True)
    print(f"dropped {args.job_id} from the dead-letter set of queue {settings.queue}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``dead-letter`` (list, show, retry, drop) to the ``edgeq`` parser."""
    dead_letter = commands.add_parser(
        "dead-letter", help="list, show, retry and drop quarantined jobs (docs/dead-letter.md)"
    )
    actions = dead_letter.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="every quarantined job: id, when, why, tenant, model")
    listing.add_argument("--json", action="store_true", help="print it as JSON")
    show = actions.add_parser("show", help="one quarantined job and its request")
    retry = actions.add_parser(
        "retry", help="lift its refusal at the door, enqueue its request again; prints the new id"
    )
    retry.add_argument(
        "--keep", action="store_true", help="keep the entry (by default a retried one is dropped)"
    )
    drop = actions.add_parser(
        "drop", help="forget a quarantined job, and accept its request at the door again"
    )
    for parser in (show, retry, drop):
        parser.add_argument("job_id", help="the quarantined job's id (from `list`)")
    for parser in (listing, show):
        parser.add_argument(
            "--show-prompt", action="store_true", help="print the messages' text too"
        )
    for parser, handler in ((listing, _list), (show, _show), (retry, _retry), (drop, _drop)):
        _connection_options(parser)
        parser.set_defaults(handler=_run_producer_command("dead-letter", handler))
