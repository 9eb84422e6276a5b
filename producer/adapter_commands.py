"""``edgeq adapters load NAME PATH | unload NAME | list``: the queue's LoRA adapter registry
(core/adapters.py). Every worker on the queue follows it within a lease renewal period
(EDGEQ_LEASE_TTL_S / 4) and a worker started later loads what it holds; ``load`` and
``unload`` wait (``--wait``) until the live workers report the change, and say which of them
refused the adapter and why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from redis.asyncio import Redis

from edgeq.core.adapters import adapter_problem, name_problem, registered, unregister
from edgeq.core.adapters import register as register_adapter
from edgeq.core.connection import make_redis, redis_errors
from edgeq.core.errors import InvalidRequest
from edgeq.core.registry import WorkerInfo, live_workers
from edgeq.exit_codes import EXIT_JOB_FAILED, EXIT_OK
from edgeq.producer.commands import (
    _connection_options,
    _connection_settings,
    _print_error,
    _run_producer_command,
)

# How often a waiting load or unload reads the workers' records back.
POLL_S = 0.25


async def _settled(
    redis: Redis, queue: str, name: str, *, loaded: bool, wait_s: float
) -> list[WorkerInfo]:
    """The live workers once each serves ``name`` or refused it (``loaded``), or neither serves
    nor refuses it any more (not ``loaded``), or when ``wait_s`` ran out. An unload waits for
    the refusal to go too: a ``load`` of the same name right after it would otherwise take the
    old refusal for its answer, and the worker, once it synced, would drop it and report
    nothing (make test-stress found it)."""
    deadline = time.monotonic() + wait_s
    while True:
        workers = await live_workers(redis, queue)
        if loaded:
            done = all(name in w.adapters or name in w.adapters_refused for w in workers)
        else:
            done = all(name not in w.adapters and name not in w.adapters_refused for w in workers)
        if done or time.monotonic() >= deadline:
            return workers
        await asyncio.sleep(POLL_S)


async def _load(args: argparse.Namespace) -> int:
    if problem := name_problem(args.name):
        raise InvalidRequest(problem)
    path = args.path
    if not args.no_check:  # a few small reads before the command's one round trip
        path = str(Path(path).resolve())  # noqa: ASYNC240
        if problem := adapter_problem(path):
            raise InvalidRequest(f"adapter {args.name!r}: {problem}")
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            await register_adapter(redis, settings.queue, args.name, path)
            print(f"adapter {args.name} registered for queue {settings.queue}: {path}")
            workers = await _settled(redis, settings.queue, args.name, loaded=True,
                                     wait_s=args.wait)  # fmt: skip
    finally:
        await redis.aclose(close_connection_pool=True)
    refused = 0
    for worker in workers:
        if args.name in worker.adapters:
            print(f"  {worker.worker_id}: serving it")
        elif why := worker.adapters_refused.get(args.name):
            refused += 1
            print(f"  {worker.worker_id}: refused it: {why}")
        else:
            print(f"  {worker.worker_id}: not yet (no report within {args.wait:g} s)")
    if refused:
        _print_error("adapters", f"{refused} worker(s) refused adapter {args.name!r} (above)")
        return EXIT_JOB_FAILED
    return EXIT_OK


async def _unload(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            if not await unregister(redis, settings.queue, args.name):
                raise InvalidRequest(
                    f"adapter {args.name!r} is not registered for queue {settings.queue} "
                    f"(a worker's own EDGEQ_ADAPTERS are not unloaded from here)"
                )
            print(f"adapter {args.name} unregistered from queue {settings.queue}")
            workers = await _settled(redis, settings.queue, args.name, loaded=False,
                                     wait_s=args.wait)  # fmt: skip
    finally:
        await redis.aclose(close_connection_pool=True)
    for worker in workers:
        state = "still serving it" if args.name in worker.adapters else "unloaded"
        print(f"  {worker.worker_id}: {state}")
    return EXIT_OK


async def _list(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            entries = await registered(redis, settings.queue)
            workers = await live_workers(redis, settings.queue)
    finally:
        await redis.aclose(close_connection_pool=True)
    if args.json:
        report = {
            "registered": entries,
            "workers": {
                w.worker_id: {"adapters": w.adapters, "refused": w.adapters_refused}
                for w in workers
            },
        }
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"registered for queue {settings.queue}:" if entries else "registered: none")
    for name, path in sorted(entries.items()):
        print(f"  {name}  {path}")
    for worker in workers:
        print(f"{worker.worker_id}: serving {', '.join(worker.adapters) or 'none'}")
        for name, why in sorted(worker.adapters_refused.items()):
            print(f"  refused {name}: {why}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``adapters`` (load, unload, list) to the ``edgeq`` parser."""
    adapters = commands.add_parser(
        "adapters", help="load, unload and list the queue's LoRA adapters (docs/adapters.md)"
    )
    actions = adapters.add_subparsers(dest="action", required=True, metavar="ACTION")
    load = actions.add_parser("load", help="register an adapter; every worker loads it")
    load.add_argument("name", help="the adapter's name: requests' `adapter`, the gateway's model")
    load.add_argument("path", help="its PEFT directory, as the workers see it")
    load.add_argument(
        "--no-check",
        action="store_true",
        help="the path is not on this machine: skip checking it here (workers still do)",
    )
    unload = actions.add_parser("unload", help="unregister an adapter; workers drop it")
    unload.add_argument("name")
    listing = actions.add_parser("list", help="the registered adapters and each worker's")
    listing.add_argument("--json", action="store_true", help="print it as JSON")
    for parser in (load, unload):
        parser.add_argument(
            "--wait", type=float, default=10.0, help="seconds to wait for workers to report"
        )
    for parser, handler in ((load, _load), (unload, _unload), (listing, _list)):
        _connection_options(parser)
        parser.set_defaults(handler=_run_producer_command("adapters", handler))
