"""``/health`` and ``/ready``: what a load balancer or systemd asks. Neither needs an API key,
so a probe never has to hold one."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from edgeq.core.connection import redis_errors
from edgeq.core.errors import RedisUnavailable
from edgeq.core.registry import WorkerInfo, live_workers
from edgeq.gateway.state import ClientDep, SettingsDep

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (say nothing about Redis or workers: that is /ready)."""
    return {"status": "ok"}


def _why_none(workers: list[WorkerInfo]) -> str:
    """What the live workers that are not warm are doing, for /ready's reason."""
    states = Counter(worker.state for worker in workers)
    if not states:
        return ""
    said = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
    stalled = " (their engine holds work and makes no step)" if states["stalled"] else ""
    return f": {said}{stalled}"


@router.get("/ready")
async def ready(client: ClientDep, settings: SettingsDep) -> JSONResponse:
    """Redis answers and at least one warm worker serves the queue."""
    try:
        with redis_errors(settings.redis_url):
            await client.redis.ping()
            workers = await live_workers(client.redis, settings.queue)
    except RedisUnavailable as error:
        return JSONResponse({"status": "unavailable", "reason": str(error)}, status_code=503)
    warm = [worker for worker in workers if worker.state == "ready"]
    if not warm:
        reason = f"no warm worker serves queue {settings.queue}{_why_none(workers)}"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ready", "workers": len(warm), "queue": settings.queue})
