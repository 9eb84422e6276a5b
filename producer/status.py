"""``edgeq status``: one queue as Redis sees it, for a person or (``--json``) a script."""

from __future__ import annotations

import time

from pydantic import BaseModel
from redis.asyncio import Redis

from edgeq.core.registry import QueueDepth, WorkerInfo, live_workers, queue_depth, recent_outcomes
from edgeq.core.settings import ConnectionSettings, redacted_url

#: The windows "recent outcomes" are counted over, by name.
OUTCOME_WINDOWS_S = {"last_5m": 300, "last_1h": 3600}
WORKER_COLUMNS = (
    "worker", "state", "device", "model", "profile", "running", "heartbeat", "metrics",
)  # fmt: skip


class QueueStatus(BaseModel):
    queue: str
    redis_url: str  # password redacted
    checked_at: float
    depth: QueueDepth
    capacity: int  # jobs the live workers can run at once
    workers: list[WorkerInfo]
    outcomes: dict[str, dict[str, int]]  # window name -> outcome -> jobs


async def read_status(redis: Redis, settings: ConnectionSettings) -> QueueStatus:
    now_s = time.time()
    workers = await live_workers(redis, settings.queue)
    return QueueStatus(
        queue=settings.queue,
        redis_url=redacted_url(settings.redis_url),
        checked_at=now_s,
        depth=await queue_depth(redis, settings.queue),
        capacity=sum(worker.max_jobs for worker in workers if worker.state == "ready"),
        workers=workers,
        outcomes=await recent_outcomes(
            redis, settings.queue, windows_s=OUTCOME_WINDOWS_S, now_s=now_s
        ),
    )


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def _counts(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{outcome} {count}" for outcome, count in outcomes.items()) or "none"


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
                worker.state,
                worker.device,
                worker.model,
                worker.profile or "-",
                f"{worker.running}/{worker.max_jobs}",
                f"{max(0.0, status.checked_at - worker.heartbeat_at):.1f} s ago",
                f"{worker.host}:{worker.metrics_port}" if worker.metrics_port else "off",
            ])  # fmt: skip
        lines += _table(rows)
    else:
        lines.append("no live worker: jobs wait until one starts (or their deadline passes)")
    lines.append("")
    for name, outcomes in status.outcomes.items():
        window = name.removeprefix("last_")
        lines.append(f"ended in the last {window}: {_counts(outcomes)}")
    return "\n".join(lines)
