"""``edgeq tenants limits show | set TENANT --rpm N ...``: the tenants' (and named API keys')
rate limits and token budgets as the queue applies them now (docs/limits.md), and a change to
them at run time.

A change is written to the queue's tenancy hash, where every enqueue reads it from its next
submit on; a worker starting later publishes its own settings (EDGEQ_TENANT_RPM and the rest)
over it, so a lasting change goes into the workers' env file too.
"""

from __future__ import annotations

import argparse
import json
import re

from edgeq.core.connection import make_redis, redis_errors
from edgeq.core.errors import InvalidRequest
from edgeq.core.limits import LimitName, read_usage, set_limit
from edgeq.core.scheduling import (
    KEY_LIMIT_FIELDS,
    LIMIT_FIELDS,
    TENANT_PATTERN,
    Tenancy,
    read_tenancy,
)
from edgeq.exit_codes import EXIT_OK
from edgeq.producer.commands import (
    _connection_options,
    _connection_settings,
    _run_producer_command,
)

#: The options of ``set``, by limit: the flag and what it says.
OPTIONS: dict[str, str] = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute (prompt, estimated, plus max_tokens)",
    "tokens_per_day": "tokens per UTC day",
    "tokens_per_month": "tokens per UTC calendar month",
}


def _limited_tenants(tenancy: Tenancy) -> list[str]:
    return sorted({tenant for name in LIMIT_FIELDS for tenant in tenancy.limits_of(name)})


def _limited_keys(tenancy: Tenancy) -> list[str]:
    return sorted({key for name in KEY_LIMIT_FIELDS for key in tenancy.key_limits_of(name)})


async def _show(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            tenancy = await read_tenancy(redis, settings.queue) or Tenancy()
            report = {
                tenant: {
                    "limits": {name: tenancy.limits_of(name).get(tenant) for name in LIMIT_FIELDS},
                    "used": (await read_usage(redis, settings.queue, tenant)).model_dump(),
                }
                for tenant in _limited_tenants(tenancy)
            }
            # An API key's row is named key:<name> (a tenant name holds no ':').
            for key_name in _limited_keys(tenancy):
                used = await read_usage(redis, settings.queue, key_name, key=True)
                report[f"key:{key_name}"] = {
                    "limits": {n: tenancy.key_limits_of(n).get(key_name) for n in LIMIT_FIELDS},
                    "used": used.model_dump(),
                }
    finally:
        await redis.aclose(close_connection_pool=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    if not report:
        print(f"queue {settings.queue}: no tenant or API key has limits")
        return EXIT_OK
    heads = ("rpm (used)", "tpm (used)", "tokens/day (used)", "tokens/month (used)")
    print(f"{'tenant':<24}" + "".join(f"{head:>24}" for head in heads))
    for tenant, entry in report.items():
        limits, used = entry["limits"], list(entry["used"].values())
        cells = [
            f"{limits[name] if limits[name] is not None else '-'} ({count})"
            for name, count in zip(LIMIT_FIELDS, used, strict=True)
        ]
        print(f"{tenant:<24}" + "".join(f"{cell:>24}" for cell in cells))
    return EXIT_OK


async def _set(args: argparse.Namespace) -> int:
    if not re.fullmatch(TENANT_PATTERN, args.tenant):
        what = "an API key name" if args.key else "a tenant name"
        raise InvalidRequest(f"{args.tenant!r} is not {what}")
    changes = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    if not changes:
        raise InvalidRequest("limits: name one at least (--rpm, --tpm, --tokens-per-day, ...)")
    if any(value < 0 for value in changes.values()):
        raise InvalidRequest("limits: a limit is a count, 0 for none")
    settings = _connection_settings(args)
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            for name, value in changes.items():
                limit: LimitName = name  # type: ignore[assignment]
                await set_limit(redis, settings.queue, args.tenant, limit, value, key=args.key)
    finally:
        await redis.aclose(close_connection_pool=True)
    said = ", ".join(f"{name} {value or 'none'}" for name, value in changes.items())
    print(f"{'API key' if args.key else 'tenant'} {args.tenant} on queue {settings.queue}: {said}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``tenants`` (limits show, limits set) to the ``edgeq`` parser."""
    tenants = commands.add_parser(
        "tenants", help="the tenants' rate limits and token budgets (docs/limits.md)"
    )
    topics = tenants.add_subparsers(dest="topic", required=True, metavar="TOPIC")
    limits = topics.add_parser("limits", help="show or change the tenants' limits")
    actions = limits.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="each limited tenant's limits and usage now")
    show.add_argument("--json", action="store_true", help="print it as JSON")
    change = actions.add_parser("set", help="change a tenant's limits now (0: none)")
    change.add_argument("tenant", help="the tenant, or with --key the API key's name")
    change.add_argument(
        "--key", action="store_true", help="TENANT names an API key (key_name), not a tenant"
    )
    for name, what in OPTIONS.items():
        change.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, help=what)
    for parser, handler in ((show, _show), (change, _set)):
        _connection_options(parser)
        parser.set_defaults(handler=_run_producer_command("tenants", handler))
