"""``edgeq status``: one queue as Redis sees it, for a person or (``--json``) a script."""

from __future__ import annotations

import time

from pydantic import BaseModel
from redis.asyncio import Redis

from edgeq.core.registry import QueueDepth, WorkerInfo, live_workers, queue_depth, recent_outcomes
from edgeq.core.scheduling import Tenancy, queued_by_tenant, read_tenancy
from edgeq.core.settings import ConnectionSettings, redacted_url

#: The windows "recent outcomes" are counted over, by name.
OUTCOME_WINDOWS_S = {"last_5m": 300, "last_1h": 3600}
#: Outcome tallies of one tenant are kept as tenant:<name>:<outcome> (core/events.py).
TENANT_OUTCOME_PREFIX = "tenant:"
TENANT_COLUMNS = ("tenant", "weight", "max queued", "queued", "running", "ended (5m)")
WORKER_COLUMNS = (
    "worker", "state", "device", "model", "profile", "running", "heartbeat", "metrics",
)  # fmt: skip


class TenantStatus(BaseModel):
    tenant: str
    weight: float
    max_queued: int | None  # None: no cap
    queued: int
    running: int  # on the live workers
    outcomes: dict[str, dict[str, int]]  # window name -> outcome -> jobs its workers ended


class QueueStatus(BaseModel):
    queue: str
    redis_url: str  # password redacted
    checked_at: float
    depth: QueueDepth
    capacity: int  # jobs the live workers can run at once
    workers: list[WorkerInfo]
    outcomes: dict[str, dict[str, int]]  # window name -> outcome -> jobs
    tenancy: Tenancy | None  # the rules the workers published (None: no worker started yet)
    tenants: list[TenantStatus]


def _split_tenants(
    outcomes: dict[str, dict[str, int]],
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, dict[str, int]]]]:
    """The queue's tallies, and each tenant's (tenant -> window -> outcome -> jobs)."""
    overall: dict[str, dict[str, int]] = {}
    by_tenant: dict[str, dict[str, dict[str, int]]] = {}
    for window, counts in outcomes.items():
        overall[window] = {}
        for field, jobs in counts.items():
            if field.startswith(TENANT_OUTCOME_PREFIX):
                tenant, _, outcome = field.removeprefix(TENANT_OUTCOME_PREFIX).rpartition(":")
                by_tenant.setdefault(tenant, {}).setdefault(window, {})[outcome] = jobs
            else:
                overall[window][field] = jobs
    return overall, by_tenant


async def read_status(redis: Redis, settings: ConnectionSettings) -> QueueStatus:
    now_s = time.time()
    workers = await live_workers(redis, settings.queue)
    tenancy = await read_tenancy(redis, settings.queue)
    queued = await queued_by_tenant(redis, settings.queue)
    running: dict[str, int] = {}
    for worker in workers:
        for tenant, jobs in worker.running_by_tenant.items():
            running[tenant] = running.get(tenant, 0) + jobs
    outcomes, tenant_outcomes = _split_tenants(
        await recent_outcomes(redis, settings.queue, windows_s=OUTCOME_WINDOWS_S, now_s=now_s)
    )
    rules = tenancy or Tenancy()
    names = sorted({*rules.named_tenants, *queued, *running, *tenant_outcomes})
    return QueueStatus(
        queue=settings.queue,
        redis_url=redacted_url(settings.redis_url),
        checked_at=now_s,
        depth=await queue_depth(redis, settings.queue),
        capacity=sum(worker.max_jobs for worker in workers if worker.state == "ready"),
        workers=workers,
        outcomes=outcomes,
        tenancy=tenancy,
        tenants=[
            TenantStatus(
                tenant=name,
                weight=rules.weight_of(name),
                max_queued=rules.max_queued.get(name),
                queued=queued.get(name, 0),
                running=running.get(name, 0),
                outcomes=tenant_outcomes.get(name, {}),
            )
            for name in names
        ],
    )


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def _counts(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{outcome} {count}" for outcome, count in outcomes.items()) or "none"


def _adapter_lines(workers: list[WorkerInfo]) -> list[str]:
    """Each worker's LoRA adapters (docs/adapters.md), for the workers that hold or refused any."""
    lines = []
    for worker in workers:
        if worker.adapters:
            lines.append(f"  {worker.worker_id} adapters: {', '.join(worker.adapters)}")
        for name, why in sorted(worker.adapters_refused.items()):
            lines.append(f"  {worker.worker_id} refused adapter {name}: {why}")
    return lines


def _state(worker: WorkerInfo, now_s: float) -> str:
    """The worker's state; a stalled one's with how long ago its engine was found stalled."""
    if worker.state == "stalled" and worker.stalled_since is not None:
        return f"stalled {max(0.0, now_s - worker.stalled_since):.0f} s"
    return worker.state


def render_status(status: QueueStatus) -> str:
    lines = [
        f"queue {status.queue} on {status.redis_url}",
        f"  waiting {status.depth.waiting}   running {status.depth.running}   "
        f"workers {len(status.workers)} (room for {status.capacity} at once)",
        "",
    ]
    if status.workers:
        rows = [list(WORKER_COLUMNS)]
        for worker in status.workers:
            rows.append([
                worker.worker_id,
                _state(worker, status.checked_at),
                worker.device,
                worker.model,
                worker.profile or "-",
                f"{worker.running}/{worker.max_jobs}",
                f"{max(0.0, status.checked_at - worker.heartbeat_at):.1f} s ago",
                f"{worker.host}:{worker.metrics_port}" if worker.metrics_port else "off",
            ])  # fmt: skip
        lines += _table(rows)
        lines += _adapter_lines(status.workers)
    else:
        lines.append("no live worker: jobs wait until one starts (or their deadline passes)")
    lines.append("")
    for name, outcomes in status.outcomes.items():
        window = name.removeprefix("last_")
        lines.append(f"ended in the last {window}: {_counts(outcomes)}")
    if status.tenants:
        lines.append("")
        rows = [list(TENANT_COLUMNS)]
        for tenant in status.tenants:
            rows.append([
                tenant.tenant,
                f"{tenant.weight:g}",
                str(tenant.max_queued) if tenant.max_queued else "-",
                str(tenant.queued),
                str(tenant.running),
                _counts(tenant.outcomes.get("last_5m", {})),
            ])  # fmt: skip
        lines += _table(rows)
    if status.tenancy is not None:
        aging = status.tenancy.aging_s
        lines.append(
            f"priority aging: a queued job moves up one class every {aging:g} s"
            if aging
            else "priority aging: off (strict priority)"
        )
    return "\n".join(lines)
