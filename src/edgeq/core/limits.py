"""Tenants' rate limits and token budgets, enforced at the door (docs/limits.md).

Four limits per tenant, each a worker setting published to the queue's tenancy hash
(core/scheduling.py ``Tenancy``) and changeable there at run time (``edgeq tenants limits``):
requests per minute (``rpm``), tokens per minute (``tpm``), tokens per UTC day and per UTC
month. A tenant with none set is not counted at all.

- **Admission** is part of the enqueue script (lua/enqueue.lua with lua/limits.lua), in the
  same Redis step as the queue's own checks: a burst of submits can never pass a limit. A chat
  costs one request and its tokens: its prompt, estimated (``estimate_prompt_tokens``), and
  its whole ``max_tokens`` (the workers' EDGEQ_MAX_TOKENS when it sets none), reserved at once.
- **Settlement**, when the job ends, in the step that writes its terminal event, whoever
  writes it (lua/publish_event.lua with lua/settle.lua, core/events.py): the reservation is
  replaced by what the chat used, in every window it was admitted in that is still current.
  A ``done`` counts the exact prompt and the completion tokens it produced; an error, a
  cancel, ``expired``, ``worker_lost`` or ``poison_job`` counts the prompt's estimate and no
  completion tokens, or nothing at all when the job wrote nothing before it (it never ran).

Windows are fixed, on Redis's clock: the UTC minute, day and calendar month.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from edgeq.core.keys import key_limits_usage_key, limits_usage_key, tenancy_key
from edgeq.core.protocol import dump_json
from edgeq.core.scheduling import KEY_LIMIT_FIELDS, LIMIT_FIELDS

#: A prompt's tokens are estimated at admission as one per this many characters of its
#: messages (and tools) as JSON: OpenAI's rule of thumb for English. The settlement replaces
#: the estimate by the engine's exact count.
CHARS_PER_TOKEN = 4

LimitName = Literal["rpm", "tpm", "tokens_per_day", "tokens_per_month"]
#: Which limit refused a chat (the enqueue's reply; OpenAI's words for the first two).
Refusal = Literal["requests", "tokens", "tokens_per_day", "tokens_per_month"]
#: Whose limit refused it: the tenant's, or the named API key's the request came with.
Scope = Literal["tenant", "key"]
#: Which setting each refusal comes from (a key's: EDGEQ_KEY_ instead of EDGEQ_TENANT_).
SETTING_OF: dict[str, str] = {
    "requests": "EDGEQ_TENANT_RPM",
    "tokens": "EDGEQ_TENANT_TPM",
    "tokens_per_day": "EDGEQ_TENANT_TOKENS_PER_DAY",
    "tokens_per_month": "EDGEQ_TENANT_TOKENS_PER_MONTH",
}


def estimate_prompt_tokens(request: Mapping[str, Any]) -> int:
    """A chat's prompt tokens as admission counts them: its messages' and tools' JSON
    characters over CHARS_PER_TOKEN, rounded up (at least 1)."""
    counted = {key: request[key] for key in ("messages", "tools") if key in request}
    return max(1, math.ceil(len(dump_json(counted)) / CHARS_PER_TOKEN))


class RateLimitRefusal(BaseModel):
    """Why a chat was refused at the door, with what OpenAI's rate-limit headers say."""

    limit: Refusal
    scope: Scope = Field("tenant", description="whose limit: the tenant's or the API key's")
    value: int = Field(ge=0, description="the limit that refused it")
    remaining: int = Field(ge=0, description="what is left of it in its window")
    reset_s: float = Field(ge=0, description="until its window turns")
    # The minute's two limits whichever refused (0: not set).
    requests_limit: int = Field(ge=0)
    requests_remaining: int = Field(ge=0)
    tokens_limit: int = Field(ge=0)
    tokens_remaining: int = Field(ge=0)
    minute_reset_s: float = Field(ge=0)

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> RateLimitRefusal:
        """The enqueue script's RATE_LIMITED reply (lua/limits.lua admit), after its code."""
        which = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        numbers = [int(value) for value in reply[1:9]]
        scope = reply[9] if len(reply) > 9 else b"tenant"  # absent before keys had limits
        return cls(
            limit=which,  # type: ignore[arg-type]
            scope=scope.decode() if isinstance(scope, bytes) else str(scope),
            value=numbers[0],
            remaining=numbers[1],
            reset_s=numbers[2] / 1000,
            requests_limit=numbers[3],
            requests_remaining=numbers[4],
            tokens_limit=numbers[5],
            tokens_remaining=numbers[6],
            minute_reset_s=numbers[7] / 1000,
        )

    @property
    def setting(self) -> str:
        setting = SETTING_OF[self.limit]
        return setting.replace("_TENANT_", "_KEY_") if self.scope == "key" else setting

    def whose(self, tenant: str, key_name: str | None) -> str:
        """Whose limit it was, in words: ``tenant support`` or ``API key web (tenant
        support)``."""
        if self.scope == "key":
            return f"API key {key_name} (tenant {tenant})"
        return f"tenant {tenant}"


def waiting_reason(tenant: str, refusal: RateLimitRefusal, key_name: str | None = None) -> str:
    """What a batch whose lines this refusal holds back says while they wait."""
    until = datetime.now(UTC) + timedelta(seconds=refusal.reset_s)
    return (
        f"lines wait: {refusal.whose(tenant, key_name)}'s {refusal.limit.replace('_', ' ')} "
        f"limit ({refusal.value}, {refusal.setting}) is spent until "
        f"{until:%Y-%m-%d %H:%M:%S} UTC"
    )


async def set_limit(
    redis: Redis, queue: str, tenant: str, name: LimitName, value: int, *, key: bool = False
) -> None:
    """Change one tenant's limit at run time (0: none); with ``key``, ``tenant`` names an API
    key (a request's ``key_name``) and its limit is changed. Until a worker starts again,
    which publishes its own settings over it."""
    field = f"{(KEY_LIMIT_FIELDS if key else LIMIT_FIELDS)[name]}{tenant}"
    if value > 0:
        await redis.hset(tenancy_key(queue), field, str(value))
    else:
        await redis.hdel(tenancy_key(queue), field)


class TenantUsage(BaseModel):
    """What a limited tenant has used in the current windows (counted as admission counts:
    reservations not settled yet included)."""

    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    tokens_today: int = 0
    tokens_this_month: int = 0


def windows_at(now_ms: int) -> tuple[int, int, int]:
    """The minute, day and month ``now_ms`` is in, numbered as lua/limits.lua numbers them."""
    moment = datetime.fromtimestamp(now_ms / 1000, UTC)
    return now_ms // 60_000, now_ms // 86_400_000, moment.year * 12 + moment.month - 1


async def read_usage(
    redis: Redis, queue: str, tenant: str, *, key: bool = False
) -> TenantUsage:
    """The tenant's usage now (Redis's clock, or the tenancy hash's frozen one); with ``key``,
    ``tenant`` names an API key and the key's usage is read."""
    frozen = await redis.hget(tenancy_key(queue), "limits_clock_ms")
    if frozen is not None:
        now_ms = int(frozen)
    else:
        seconds, micros = await redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
    usage_key = key_limits_usage_key(queue, tenant) if key else limits_usage_key(queue, tenant)
    raw = {
        field.decode(): int(float(value))
        for field, value in (await redis.hgetall(usage_key)).items()
    }
    minute, day, month = windows_at(now_ms)
    same_minute = raw.get("minute") == minute
    return TenantUsage(
        requests_this_minute=raw.get("requests", 0) if same_minute else 0,
        tokens_this_minute=raw.get("tokens", 0) if same_minute else 0,
        tokens_today=raw.get("day_tokens", 0) if raw.get("day") == day else 0,
        tokens_this_month=raw.get("month_tokens", 0) if raw.get("month") == month else 0,
    )
