"""One claim: a single Lua script takes as many due jobs as the worker has free slots.

It reads the queue's head, sets arq's own in-progress key for each job it takes, writes the
job's lease on Redis's clock (core/leases.py), keeps the payload for as long as the job may run,
counts the start and takes a pending abort, and moves the fair-queuing clocks and aging on
(core/scheduling.py): whichever worker runs it first takes what it can hold, the next one takes
the rest, and no job is taken twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from edgeq.core.keys import (
    aging_key,
    fair_key,
    leases_key,
    queued_by_tenant_key,
    tenancy_key,
    tenant_of_key,
)
from edgeq.core.scripts import lua_script, registered
from edgeq.worker.arq_seam import (
    ARQ_ABORT_SET,
    IN_PROGRESS_KEY_PREFIX,
    JOB_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    START_COUNT_TTL_S,
)

# Each claim moves up at most this many aged jobs (the rest wait for the next claim, one
# poll later), so a backlog that ages all at once does not make one claim slow.
AGING_BATCH = 64

# KEYS, ARGV and what it returns: lua/claim.lua. It writes leases on Redis's clock
# (lua/clock.lua) and moves fair queuing and aging on (lua/fair_queuing.lua).
_CLAIM = lua_script("clock", "fair_queuing", "claim")


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job one claim took, with what arq's ``run_job`` would have read in its own round
    trip: the payload (None once its queue deadline passed), its start count, a pending abort."""

    job_id: str
    score: float
    payload: bytes | None
    job_try: int
    aborted: bool
    #: Its tenant-of entry, "<band it was enqueued in>:<tenant>" (None: not queued through
    #: edgeq's enqueue, or continued): what an expired job is counted under in the ledger.
    queued_as: str | None = None


async def claim_due_jobs(
    redis: Redis,
    queue: str,
    *,
    wanted: int,
    wanted_batch: int,
    scan_limit: int,
    ttl_ms: int,
    lease_ttl_ms: int,
    now_ms: int,
    abort_set: str = ARQ_ABORT_SET,
) -> list[ClaimedJob]:
    """In one round trip, take up to ``wanted`` of the first ``scan_limit`` due jobs of the
    queue (score up to ``now_ms``), lowest score first: each one not taken (arq's in-progress
    key is set only if absent, for ``ttl_ms``), at most ``wanted_batch`` of them of the batch
    class. Each one taken is leased for ``lease_ttl_ms`` from Redis's clock, its start counted
    and its payload read as arq's ``run_job`` would; the fair-queuing clocks and aging move on
    (core/scheduling.py). ``abort_set``: where aborts of queued jobs wait (arq's, or the
    queue's own on a cluster)."""
    claim = registered(redis, _CLAIM)
    claimed = await claim(
        keys=[
            queue,
            leases_key(queue),
            fair_key(queue),
            tenant_of_key(queue),
            queued_by_tenant_key(queue),
            aging_key(queue),
            tenancy_key(queue),
            abort_set,
        ],
        args=[
            now_ms,
            wanted,
            wanted_batch,
            ttl_ms,
            lease_ttl_ms,
            scan_limit,
            IN_PROGRESS_KEY_PREFIX,
            JOB_KEY_PREFIX,
            RETRY_KEY_PREFIX,
            START_COUNT_TTL_S,
            AGING_BATCH,
        ],
    )
    return [
        ClaimedJob(
            job_id=claimed[i].decode(),
            score=float(claimed[i + 1]),
            payload=claimed[i + 2],
            job_try=int(claimed[i + 3]),
            aborted=bool(claimed[i + 4]),
            queued_as=claimed[i + 5].decode() if claimed[i + 5] else None,
        )
        for i in range(0, len(claimed), 6)
    ]
