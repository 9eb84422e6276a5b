"""``GET /v1/usage``: the usage ledger's rows (edgeq.core.ledger, docs/usage.md) over HTTP, for
the operator's admin key (every tenant) or a tenant key (its own tenant). The same rows as
``edgeq usage --format json``: counts only, never a prompt's or an answer's text.

Not an OpenAI resource (OpenAI's usage API is its organisation admin API); the query follows
``edgeq usage``: ``from`` and ``to`` (UTC days, both included; default today), ``tenant``,
repeatable, and ``key``, an API key's name.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query

from edgeq.core.connection import redis_errors
from edgeq.core.errors import RedisUnavailable
from edgeq.core.ledger import days_between, read_usage, usage_day
from edgeq.core.scheduling import TENANT_PATTERN
from edgeq.gateway.auth import UsageReaderDep
from edgeq.gateway.errors import ApiError, client_error
from edgeq.gateway.state import ClientDep

router = APIRouter()


def _bad_query(param: str, message: str) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code="invalid_request", param=param)


def _day(param: str, value: str | None, default: dt.date) -> dt.date:
    if value is None:
        return default
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise _bad_query(param, f"{param}: {value[:40]!r} is not a UTC day (YYYY-MM-DD)") from None


def _tenants(asked: list[str] | None, reader: str | None) -> list[str] | None:
    """The tenants to read: those asked for (checked), the reader's own when it is one."""
    for tenant in asked or ():
        if not re.fullmatch(TENANT_PATTERN, tenant):
            raise _bad_query("tenant", f"tenant: {tenant[:70]!r} is not a tenant name")
    if reader is None:
        return asked
    if asked and set(asked) != {reader}:
        raise ApiError(
            403,
            f"this key reads tenant {reader!r}'s usage only (EDGEQ_GATEWAY_TENANT_KEYS)",
            type="permission_error",
            code="tenant_mismatch",
            param="tenant",
        )
    return [reader]


@router.get("/v1/usage")
async def usage(
    client: ClientDep,
    reader: UsageReaderDep,
    first: Annotated[str | None, Query(alias="from")] = None,
    last: Annotated[str | None, Query(alias="to")] = None,
    tenant: Annotated[list[str] | None, Query()] = None,
    key: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    today = dt.date.fromisoformat(usage_day(dt.datetime.now(dt.UTC).timestamp()))
    to_day = _day("to", last, today)
    try:
        days = days_between(_day("from", first, to_day), to_day)
    except ValueError as error:
        raise _bad_query("from", f"from, to: {error}") from None
    tenants = _tenants(tenant, reader)
    if key is not None and not re.fullmatch(TENANT_PATTERN, key):
        raise _bad_query("key", f"key: {key[:70]!r} is not an API key's name")
    try:
        with redis_errors(client.settings.redis_url):
            rows = await read_usage(
                client.redis, client.settings.queue, days, tenants=tenants, key=key
            )
    except RedisUnavailable as error:
        raise client_error(error) from None
    return {
        "object": "list",
        "from": days[0],
        "to": days[-1],
        "data": [row.model_dump(mode="json") for row in rows],
    }
