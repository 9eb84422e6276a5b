"""Who goes first: priority classes, tenants and their weights, and the queue's score.

arq's queue is a sorted set, and workers take the lowest scores first (worker/claim.py).
edgeq gives each job a score that puts it in the right place at enqueue, so claiming stays
one atomic step over the set's lowest scores, O(log n) in the queue's length:

    score = band × BAND_SPAN + start tag

- **band**: the priority class. ``interactive`` (0) before ``default`` (1) before ``batch``
  (2): a job of a lower band is taken only when no job of a higher band is queued. The same
  number goes to vLLM's priority scheduler (lower first, as vLLM counts it), so inside the
  engine too a new interactive request is scheduled before waiting batch requests.
- **start tag**: start-time fair queuing between tenants, per band. Each band has a virtual
  clock (the largest tag a worker has claimed in it); each tenant's flow in a band has the
  tag its next job starts at. A job starts at ``max(clock, flow tag)`` and moves its flow's
  tag on by ``1 / weight``. So tenants with queued work are taken in proportion to their
  weights (3 : 1 for weights 3 and 1), a tenant arriving later starts at the clock (it gets
  its share from its first job, with no credit for the time it was away), and a tenant
  alone gets everything.
- **aging** (no starvation): a job queued for ``EDGEQ_PRIORITY_AGING_S`` moves up one band,
  into its tenant's flow there, and again after as long again. So batch work waiting behind
  a steady stream of interactive chats still progresses: after twice the aging time it
  shares the interactive band by weight. ``EDGEQ_PRIORITY_AGING_S=0``: strict priority.

Weights, queued-job caps, the aging time and the tenants' rate limits and token budgets
(core/limits.py) are worker settings; each worker writes them to
``{queue}:tenancy`` when it starts, and the enqueue and claim scripts read them from there, so
producers need no copy of them (the last worker to start wins if they differ).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from edgeq.core.keys import queued_by_tenant_key, tenancy_key

Priority = Literal["interactive", "default", "batch"]
#: The priority classes, first served first; a class's index is its band and engine priority.
PRIORITIES: tuple[Priority, ...] = ("interactive", "default", "batch")
DEFAULT_PRIORITY: Priority = "default"
#: The tenant of a job that names none (and of a client with no EDGEQ_TENANT).
DEFAULT_TENANT = "default"
#: What a tenant name may look like: it is part of Redis hash fields and metric labels.
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: Width of one band of scores. Three bands end below 1.5e12, under any Unix-ms "now" arq's
#: pickup compares scores with; a tag moves on by 1/weight per job, so a band holds 5e11
#: jobs at weight 1 before it would reach the next. The scripts' side of all this,
#: lua/fair_queuing.lua, holds the same number (tests/test_lua.py checks that they agree).
BAND_SPAN = 500_000_000_000


def band_of(priority: Priority | None) -> int:
    """The band (and vLLM priority) of a class; None is the default class."""
    return PRIORITIES.index(priority or DEFAULT_PRIORITY)


#: Each tenant limit (docs/limits.md) and the prefix of its field in the tenancy hash, where
#: lua/enqueue.lua reads it: requests and tokens per minute, tokens per UTC day and month.
LIMIT_FIELDS: dict[str, str] = {
    "rpm": "rpm:",
    "tpm": "tpm:",
    "tokens_per_day": "tpd:",
    "tokens_per_month": "tpmo:",
}


#: The same limits of a named API key (a request's ``key_name``), and their prefixes: a key's
#: limits hold within its tenant's, and a chat must fit both.
KEY_LIMIT_FIELDS: dict[str, str] = {
    "rpm": "krpm:",
    "tpm": "ktpm:",
    "tokens_per_day": "ktpd:",
    "tokens_per_month": "ktpmo:",
}


class Tenancy(BaseModel):
    """The queue's sharing rules, as the workers publish them."""

    weights: dict[str, float] = Field(default_factory=dict)
    max_queued: dict[str, int] = Field(default_factory=dict)
    default_weight: float = Field(1.0, gt=0)
    aging_s: float = Field(60.0, ge=0)
    # Rate limits and token budgets (core/limits.py): tenant -> its limit; unlisted: none.
    rpm: dict[str, int] = Field(default_factory=dict)
    tpm: dict[str, int] = Field(default_factory=dict)
    tokens_per_day: dict[str, int] = Field(default_factory=dict)
    tokens_per_month: dict[str, int] = Field(default_factory=dict)
    # The same per API key name (EDGEQ_KEY_RPM and the rest): key name -> its limit.
    key_rpm: dict[str, int] = Field(default_factory=dict)
    key_tpm: dict[str, int] = Field(default_factory=dict)
    key_tokens_per_day: dict[str, int] = Field(default_factory=dict)
    key_tokens_per_month: dict[str, int] = Field(default_factory=dict)
    #: The workers' EDGEQ_MAX_TOKENS: what a chat that sets no max_tokens reserves.
    max_tokens: int = Field(256, ge=1)
    #: The workers' EDGEQ_MODEL and EDGEQ_USAGE_KEEP_DAYS in seconds (0: no ledger): what a
    #: client that ends a job no worker answered (a cancel) counts it under in the usage
    #: ledger, and for how long (core/ledger.py).
    model: str = ""
    usage_keep_s: int = Field(0, ge=0)

    def limits_of(self, name: str) -> dict[str, int]:
        """One of LIMIT_FIELDS' limits, tenant -> value."""
        limits: dict[str, int] = getattr(self, name)
        return limits

    def key_limits_of(self, name: str) -> dict[str, int]:
        """One of KEY_LIMIT_FIELDS' limits, API key name -> value."""
        limits: dict[str, int] = getattr(self, f"key_{name}")
        return limits

    def weight_of(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    @property
    def named_tenants(self) -> list[str]:
        return sorted(
            {*self.weights, *self.max_queued, *(t for n in LIMIT_FIELDS for t in self.limits_of(n))}
        )


async def publish_tenancy(redis: Redis, queue: str, tenancy: Tenancy) -> None:
    fields = {
        "default_weight": repr(tenancy.default_weight),
        "aging_ms": str(int(tenancy.aging_s * 1000)),
        **{f"weight:{tenant}": repr(weight) for tenant, weight in tenancy.weights.items()},
        **{f"max_queued:{tenant}": str(cap) for tenant, cap in tenancy.max_queued.items()},
        "max_tokens": str(tenancy.max_tokens),
        "model": tenancy.model,
        "usage_keep_s": str(tenancy.usage_keep_s),
        **{
            f"{prefix}{tenant}": str(value)
            for name, prefix in LIMIT_FIELDS.items()
            for tenant, value in tenancy.limits_of(name).items()
        },
        **{
            f"{prefix}{key_name}": str(value)
            for name, prefix in KEY_LIMIT_FIELDS.items()
            for key_name, value in tenancy.key_limits_of(name).items()
        },
    }
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(tenancy_key(queue))
        pipe.hset(tenancy_key(queue), mapping=fields)
        await pipe.execute()


async def read_tenancy(redis: Redis, queue: str) -> Tenancy | None:
    """The rules the workers last published; None before any worker started."""
    raw = {
        key.decode(): value.decode()
        for key, value in (await redis.hgetall(tenancy_key(queue))).items()
    }
    if not raw:
        return None
    return Tenancy(
        weights={
            key.removeprefix("weight:"): float(value)
            for key, value in raw.items()
            if key.startswith("weight:")
        },
        max_queued={
            key.removeprefix("max_queued:"): int(value)
            for key, value in raw.items()
            if key.startswith("max_queued:")
        },
        default_weight=float(raw.get("default_weight", "1")),
        aging_s=int(raw.get("aging_ms", "0")) / 1000,
        max_tokens=int(raw.get("max_tokens", "256")),
        model=raw.get("model", ""),
        usage_keep_s=int(raw.get("usage_keep_s", "0")),
        **{
            name: {
                key.removeprefix(prefix): int(value)
                for key, value in raw.items()
                if key.startswith(prefix)
            }
            for name, prefix in LIMIT_FIELDS.items()
        },
        **{
            f"key_{name}": {
                key.removeprefix(prefix): int(value)
                for key, value in raw.items()
                if key.startswith(prefix)
            }
            for name, prefix in KEY_LIMIT_FIELDS.items()
        },
    )


async def queued_by_tenant(redis: Redis, queue: str) -> dict[str, int]:
    """Jobs queued and not yet claimed, per tenant (tenants with none left out)."""
    counts = await redis.hgetall(queued_by_tenant_key(queue))
    return {
        tenant.decode(): int(count) for tenant, count in sorted(counts.items()) if int(count) > 0
    }
