"""``/health`` and ``/ready``: what a load balancer or systemd asks. Neither needs an API key,
so a probe never has to hold one."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from edgeq.core.connection import redis_errors
from edgeq.core.errors import RedisUnavailable
from edgeq.core.registry import live_workers
from edgeq.gateway.state import ClientDep, SettingsDep

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (say nothing about Redis or workers: that is /ready)."""
    return {"status": "ok"}


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
        reason = f"no warm worker serves queue {settings.queue}"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ready", "workers": len(warm), "queue": settings.queue})
