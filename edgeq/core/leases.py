"""Leases: how a job whose worker died still gets its terminal event.

A running job's worker renews its lease every ``EDGEQ_LEASE_TTL_S`` / 4; anyone who sees a
lease run out (another worker's keep-alive round, or the waiting client itself) ends the job
with ``worker_lost`` through the event log, so exactly one terminal event still holds.
"""

from __future__ import annotations

from redis.asyncio import Redis

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import in_progress_key, job_key, leases_key
from edgeq.core.protocol import ErrorEvent

# Expiry = Redis's clock when the renewal lands + the TTL, not the worker's clock when it sent
# it: a renewal held up in a stalled event loop (seen for 14 s on a 2-core box running two
# engines) must not arrive already expired and get a live job declared lost. One clock for
# every lease decision also keeps clock skew between boxes out of it.


def lease_expiry_lua(ttl_ms: str) -> str:
    """A Lua line setting ``expiry``: Redis's clock (Unix ms) + ``ttl_ms`` (a Lua expression),
    for every script that writes a lease (renewal here, the worker's claim)."""
    return (
        "local clock = redis.call('TIME')\n"
        "local expiry = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)"
        f" + tonumber({ttl_ms})\n"
    )


_RENEW = (
    lease_expiry_lua("ARGV[1]")
    + """
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], expiry, ARGV[i])
end
"""
)


async def redis_now_ms(redis: Redis) -> int:
    seconds, microseconds = await redis.time()
    return int(seconds) * 1000 + int(microseconds) // 1000


async def renew_leases(redis: Redis, queue: str, job_ids: list[str], *, ttl_s: float) -> None:
    """A worker's promise that these jobs are alive for ``ttl_s`` from now (on Redis's clock)."""
    if job_ids:
        renew = redis.register_script(_RENEW)
        await renew(keys=[leases_key(queue)], args=[int(ttl_s * 1000), *job_ids])


async def release_lease(redis: Redis, queue: str, job_id: str) -> None:
    await redis.zrem(leases_key(queue), job_id)


async def lease_expired(redis: Redis, queue: str, job_id: str) -> bool:
    expiry_ms = await redis.zscore(leases_key(queue), job_id)
    return expiry_ms is not None and expiry_ms < await redis_now_ms(redis)


async def declare_lost(redis: Redis, log: EventLog, job_id: str, *, queue: str) -> bool:
    """End a job whose worker stopped renewing its lease, and make sure arq never re-runs it
    (a half-streamed answer is never generated twice). True if this call ended it."""
    event = ErrorEvent(
        job_id=job_id,
        seq=0,
        code="worker_lost",
        message=(
            "the worker running this job stopped (crash, kill or power loss) before it "
            "finished; the job was not re-run, so it is safe to submit it again"
        ),
    )
    try:
        await log.append(event)
        ended = True
    except StreamClosed:
        ended = False
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(leases_key(queue), job_id)
        pipe.zrem(queue, job_id)
        pipe.delete(in_progress_key(job_id), job_key(job_id))
        await pipe.execute()
    return ended


async def reap_lost_jobs(redis: Redis, log: EventLog, *, queue: str) -> list[str]:
    """Declare lost every job whose lease ran out; returns the ids this call ended."""
    expired = await redis.zrangebyscore(leases_key(queue), "-inf", await redis_now_ms(redis))
    ended = []
    for raw in expired:
        job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        if await declare_lost(redis, log, job_id, queue=queue):
            ended.append(job_id)
    return ended
