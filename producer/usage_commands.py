"""``edgeq usage``: the usage ledger's rows (core/ledger.py, docs/usage.md) per tenant, UTC day,
API key, model and class, as a table, JSON or CSV. Counts only: the ledger holds no text of a
prompt or an answer.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import re

from edgeq.core.connection import make_redis, redis_errors
from edgeq.core.errors import InvalidRequest
from edgeq.core.ledger import COUNTERS, UsageRow, days_between, read_usage, usage_day
from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.exit_codes import EXIT_OK
from edgeq.producer.commands import (
    _connection_options,
    _connection_settings,
    _run_producer_command,
)

#: The columns of the table and the CSV, in order; ``class`` is a row's ``priority``.
COLUMNS = ("tenant", "day", "key", "model", "class", *COUNTERS, "errors")


def _cells(row: UsageRow) -> list[str]:
    errors = ";".join(f"{code}={count}" for code, count in sorted(row.errors.items()))
    counters = [str(getattr(row, counter)) for counter in COUNTERS]
    return [row.tenant, row.day, row.key or "-", row.model, row.priority, *counters, errors or "-"]


def render_table(rows: list[UsageRow]) -> str:
    """The rows as aligned columns under a header line."""
    lines = [list(COLUMNS), *(_cells(row) for row in rows)]
    widths = [max(len(line[n]) for line in lines) for n in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def render_csv(rows: list[UsageRow]) -> str:
    """The rows as CSV with a header line; errors as ``code=count;code=count``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(_cells(row) for row in rows)
    return out.getvalue().rstrip("\n")


def _day(value: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a day (YYYY-MM-DD)") from None


def _tenant(value: str) -> str:
    if not re.fullmatch(TENANT_PATTERN, value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a tenant name (up to 64 letters, digits, '_', '.' or '-')"
        )
    return value


async def _usage(args: argparse.Namespace) -> int:
    settings = _connection_settings(args)
    today = dt.date.fromisoformat(usage_day(dt.datetime.now(dt.UTC).timestamp()))
    try:
        last = args.last or today
        days = days_between(args.first or last, last)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    redis = make_redis(settings)
    try:
        with redis_errors(settings.redis_url):
            rows = await read_usage(
                redis, settings.queue, days, tenants=args.tenant, key=args.key
            )
    finally:
        await redis.aclose(close_connection_pool=True)
    if args.format == "json":
        print(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
    elif args.format == "csv":
        print(render_csv(rows))
    else:
        print(render_table(rows) if rows else f"no usage recorded on {days[0]}..{days[-1]}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``usage`` to the ``edgeq`` parser."""
    usage = commands.add_parser(
        "usage",
        help=(
            "per tenant, UTC day, API key, model and class: jobs, tokens, errors, waits "
            "(docs/usage.md)"
        ),
    )
    usage.add_argument(
        "--tenant", action="append", type=_tenant, help="only this tenant (repeatable)"
    )
    usage.add_argument(
        "--key", type=_tenant, help="only the jobs sent with this API key (its name)"
    )
    usage.add_argument(
        "--from", dest="first", type=_day, metavar="DAY", help="first UTC day (default: the last)"
    )
    usage.add_argument(
        "--to", dest="last", type=_day, metavar="DAY", help="last UTC day (default: today)"
    )
    usage.add_argument(
        "--format", choices=("table", "json", "csv"), default="table", help="default: table"
    )
    _connection_options(usage)
    usage.set_defaults(handler=_run_producer_command("usage", _usage))
