"""``edgeq batch``: OpenAI's Batch API from the shell, straight on Redis (no gateway needed).

    edgeq batch submit requests.jsonl --wait      # upload, create, run, show progress
    edgeq batch status BATCH_ID
    edgeq batch results BATCH_ID [--errors] [-o out.jsonl]
    edgeq batch cancel BATCH_ID
    edgeq batch list
    edgeq batch usage                              # each tenant's use against its caps

It uses the same Python API as the gateway's /v1/files and /v1/batches (store.py), so a
batch submitted here shows in the gateway and the other way round. ``--wait`` runs a
BatchRunner for the batch in this process too: it works with no gateway running, and with one
it is whichever takes the batch's lease first. Needs no FastAPI.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from edgeq.core.connection import redis_errors
from edgeq.core.errors import ConfigError, EdgeqError, RedisUnavailable
from edgeq.core.logs import configure_logging
from edgeq.core.registry import live_workers
from edgeq.core.settings import load_settings
from edgeq.exit_codes import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from edgeq.producer.client import ChatClient
from edgeq.resources.batches.runner import BatchRunner
from edgeq.resources.batches.store import (
    FINAL_STATUSES,
    BatchApiError,
    BatchObject,
    BatchStore,
    TenantUsage,
)
from edgeq.resources.settings import ResourceSettings

PROGRESS_INTERVAL_S = 1.0


def _settings(args: argparse.Namespace) -> ResourceSettings:
    overrides = {
        name: value
        for name, value in (("redis_url", args.redis_url), ("queue", args.queue))
        if value is not None
    }
    return load_settings(ResourceSettings, **overrides)


def progress_line(batch: BatchObject, started: float, done_at_start: int) -> str:
    """``done/total, failed, rate, ETA`` of a running batch."""
    counts = batch.request_counts
    done = counts.completed + counts.failed
    elapsed = max(time.monotonic() - started, 1e-6)
    rate = (done - done_at_start) / elapsed
    eta = f"{(counts.total - done) / rate:.0f} s" if rate > 0 else "?"
    return (
        f"{batch.status}: {done}/{counts.total} done ({counts.failed} failed), "
        f"{rate:.1f} lines/s, ETA {eta}"
    )


def _summary(batch: BatchObject) -> str:
    counts = batch.request_counts
    parts = [
        f"{batch.id} {batch.status}: {counts.completed} completed, {counts.failed} failed"
        f" of {counts.total}"
    ]
    if batch.output_file_id:
        parts.append(f"output {batch.output_file_id}")
    if batch.error_file_id:
        parts.append(f"errors {batch.error_file_id}")
    for error in (batch.errors.data if batch.errors else [])[:20]:
        parts.append(f"  {error.message}")
    return "\n".join(parts)


async def _status(store: BatchStore, tenant: str | None, batch_id: str) -> str:
    """``edgeq batch status``: the summary, and why its lines wait if they do."""
    summary = _summary(await store.get_batch(tenant, batch_id))
    why = await store.waiting(tenant, batch_id)
    return f"{summary}\n{why}" if why else summary


def usage_table(usages: list[TenantUsage], settings: ResourceSettings) -> str:
    """Each tenant's use of Redis against its caps, one line each."""
    files, size = settings.gateway_files_per_tenant, settings.gateway_bytes_per_tenant
    batches = settings.gateway_batches_per_tenant
    lines = [f"{'tenant':<24} {'files':>10} {'bytes':>24} {'batches':>8}"]
    for usage in usages:
        lines.append(
            f"{usage.tenant:<24} {f'{usage.files}/{files}':>10} "
            f"{f'{usage.bytes:,}/{size:,}':>24} {f'{usage.active_batches}/{batches}':>8}"
        )
    lines.append(
        "caps: EDGEQ_GATEWAY_FILES_PER_TENANT, EDGEQ_GATEWAY_BYTES_PER_TENANT (files and "
        "running batches' lines), EDGEQ_GATEWAY_BATCHES_PER_TENANT (in progress)"
    )
    return "\n".join(lines)


async def _wait(
    store: BatchStore,
    client: ChatClient,
    settings: ResourceSettings,
    tenant: str,
    batch_id: str,
    quiet: bool,
) -> BatchObject:
    runner = BatchRunner(client, settings)
    run = asyncio.create_task(runner.run_forever(only=batch_id))
    started = time.monotonic()
    batch = await store.get_batch(tenant, batch_id)
    done_at_start = batch.request_counts.completed + batch.request_counts.failed
    try:
        while batch.status not in FINAL_STATUSES:
            if not quiet:
                print(
                    f"\r{progress_line(batch, started, done_at_start)}",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            batch = await store.get_batch(tenant, batch_id)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if not quiet:
            print(file=sys.stderr)
    return batch


async def _batch(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging("warning")  # the progress line is what a person at the shell reads
    tenant = args.tenant or settings.tenant
    async with ChatClient(settings) as client:
        store = BatchStore(client.redis, settings)
        with redis_errors(settings.redis_url):
            if args.action == "submit":
                content = args.file.read_bytes()
                file = await store.create_file(tenant, args.file.name, "batch", content)
                workers = await live_workers(client.redis, settings.queue)
                models = [
                    settings.model,
                    *settings.gateway_model_aliases,
                    *(worker.model for worker in workers),
                ]
                batch = await store.create_batch(tenant, file.id, models=models)
                print(batch.id)
                if batch.status == "failed":
                    print(_summary(batch), file=sys.stderr)
                    return EXIT_USAGE
                if args.wait:
                    batch = await _wait(store, client, settings, tenant, batch.id, args.quiet)
                    print(_summary(batch), file=sys.stderr)
                    return EXIT_OK if batch.status == "completed" else EXIT_JOB_FAILED
                return EXIT_OK
            if args.action == "status":
                print(await _status(store, tenant, args.batch_id))
                return EXIT_OK
            if args.action == "cancel":
                await store.cancel_batch(tenant, args.batch_id)
                # Its runner stops its lines and writes the partial output; with no gateway
                # running it, a runner here does.
                batch = await _wait(store, client, settings, tenant, args.batch_id, quiet=True)
                print(_summary(batch))
                return EXIT_OK
            if args.action == "usage":
                tenants = [args.tenant] if args.tenant else await store.tenants()
                print(usage_table([await store.usage(name) for name in tenants], settings))
                return EXIT_OK
            if args.action == "list":
                batches, _ = await store.list_batches(tenant, limit=args.limit)
                for batch in batches:
                    print(_summary(batch).splitlines()[0])
                return EXIT_OK
            batch = await store.get_batch(tenant, args.batch_id)  # results
            file_id = batch.error_file_id if args.errors else batch.output_file_id
            if file_id is None:
                what = "error" if args.errors else "output"
                print(
                    f"edgeq batch: {batch.id} is {batch.status} and has no {what} file",
                    file=sys.stderr,
                )
                return EXIT_JOB_FAILED
            content = await store.file_content(tenant, file_id)
            if args.output is not None:
                args.output.write_bytes(content)
            else:
                sys.stdout.buffer.write(content)
            return EXIT_OK


def _guarded(command: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(command(args))
        except ConfigError as error:
            print(f"edgeq batch: {error}", file=sys.stderr)
            return EXIT_CONFIG
        except OSError as error:
            print(f"edgeq batch: {error}", file=sys.stderr)
            return EXIT_USAGE
        except BatchApiError as error:
            print(f"edgeq batch: {error}", file=sys.stderr)
            return EXIT_USAGE if error.status != 404 else EXIT_JOB_FAILED
        except RedisUnavailable as error:
            print(f"edgeq batch: {error}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        except EdgeqError as error:
            print(f"edgeq batch: {error}", file=sys.stderr)
            return EXIT_JOB_FAILED
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    return run


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``batch`` to the ``edgeq`` parser."""
    batch = commands.add_parser(
        "batch", help="run a JSONL file of chat requests as an OpenAI-style batch"
    )
    actions = batch.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text)
        parser.add_argument("--redis-url", help="overrides EDGEQ_REDIS_URL")
        parser.add_argument("--queue", help="overrides EDGEQ_QUEUE")
        parser.add_argument("--tenant", help="whose batch it is (default EDGEQ_TENANT)")
        parser.set_defaults(handler=_guarded(_batch))
        return parser

    submit = action("submit", "upload a JSONL file and create a batch; prints its id")
    submit.add_argument("file", type=Path, help="OpenAI batch input: one request per line")
    submit.add_argument("--wait", action="store_true", help="run it here and show progress")
    submit.add_argument("--quiet", action="store_true", help="no progress line with --wait")
    for name, text in (
        ("status", "show a batch's status and counts"),
        ("cancel", "cancel a batch; its finished lines are kept"),
    ):
        action(name, text).add_argument("batch_id")
    results = action("results", "print a batch's output file (or its error file)")
    results.add_argument("batch_id")
    results.add_argument("--errors", action="store_true", help="the error file instead")
    results.add_argument("-o", "--output", type=Path, help="write to this file, not stdout")
    action(
        "usage",
        "each tenant's files, bytes and batches in progress against its caps (--tenant: one)",
    )
    listing = action("list", "list the tenant's batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
