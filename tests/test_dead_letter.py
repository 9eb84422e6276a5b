"""The dead-letter set and ``edgeq dead-letter`` against a real Redis (no engine): a job
quarantined by its hand-over is listed without its prompt, shown, sent again as a new job and
dropped. The engine's side (a request that kills two engines) is tests/test_poison.py."""

from __future__ import annotations

import asyncio
import os
import subprocess

from edgeq.core.dead_letter import list_dead_letters
from edgeq.core.events import read_events
from edgeq.core.keys import dead_letter_key, leases_key
from edgeq.core.leases import (
    POISON_AFTER_ENGINE_FAILURES,
    Handover,
    hand_over,
    mark_engine_failures,
)
from edgeq.core.protocol import ErrorEvent
from edgeq.exit_codes import EXIT_OK, EXIT_USAGE
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import RedisServer
from helpers import EDGEQ

PROMPT = "a secret the operator must not see by default"


async def quarantined_job(client: ChatClient, *, tenant: str = "acme") -> str:
    """A job as two dead engines leave it: enqueued (no worker here), running at two engine
    failures, its lease run out; then handed over, which quarantines it."""
    job = await client.submit(PROMPT, tenant=tenant, max_tokens=8)
    await job.aclose()
    queue = client.settings.queue
    await client.redis.zadd(leases_key(queue), {job.job_id: 1})  # expired in 1970
    for _ in range(POISON_AFTER_ENGINE_FAILURES):
        await mark_engine_failures(client.redis, [job.job_id])
    if (await client.redis.info("server"))["uptime_in_seconds"] < 1:
        await asyncio.sleep(1.0)  # leases run out only once Redis is up a lease TTL
    outcome = await hand_over(
        client.redis, client.events, job.job_id, queue=queue, max_continuations=2,
        deadline_s=30, lease_ttl_s=0.2, dead_letter_ttl_s=600,
    )  # fmt: skip
    assert outcome is Handover.QUARANTINED
    return job.job_id


def edgeq(redis_server: RedisServer, queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_QUEUE": queue}
    return subprocess.run([*EDGEQ, "dead-letter", *args], env=env, capture_output=True, text=True)


async def test_a_quarantined_job_is_listed_shown_retried_and_dropped(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        poison = await quarantined_job(client)
        other = await quarantined_job(client, tenant="globex")
        (event,) = await read_events(client.redis, poison)
        assert isinstance(event, ErrorEvent) and event.code == "poison_job"

        listed = await asyncio.to_thread(edgeq, redis_server, queue, "list")
        assert listed.returncode == EXIT_OK, listed.stderr
        assert poison in listed.stdout and other in listed.stdout
        line = next(line for line in listed.stdout.splitlines() if poison in line)
        assert "engine_failures=2" in line and "acme" in line and "(base model)" in line
        assert PROMPT not in listed.stdout  # nothing of a prompt unless asked
        shown = await asyncio.to_thread(edgeq, redis_server, queue, "list", "--show-prompt")
        assert PROMPT in shown.stdout

        show = await asyncio.to_thread(edgeq, redis_server, queue, "show", poison)
        assert show.returncode == EXIT_OK, show.stderr
        assert PROMPT not in show.stdout and f'"content_chars": {len(PROMPT)}' in show.stdout

        retried = await asyncio.to_thread(edgeq, redis_server, queue, "retry", poison)
        assert retried.returncode == EXIT_OK, retried.stderr
        new_id = retried.stdout.strip()
        assert new_id and new_id != poison
        assert await client.redis.zscore(queue, new_id) is not None  # queued as a new job
        assert await client.redis.zscore(queue, poison) is None  # the old one never runs

        dropped = await asyncio.to_thread(edgeq, redis_server, queue, "drop", other)
        assert dropped.returncode == EXIT_OK, dropped.stderr
        assert await list_dead_letters(client.redis, queue, ttl_s=600) == []
        assert await client.redis.zcard(dead_letter_key(queue)) == 0

        missing = await asyncio.to_thread(edgeq, redis_server, queue, "drop", other)
        assert missing.returncode == EXIT_USAGE
        assert "not in the dead-letter set" in missing.stderr


async def test_an_entry_past_its_ttl_is_forgotten(redis_server: RedisServer, queue: str) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        await quarantined_job(client)
        assert len(await list_dead_letters(client.redis, queue, ttl_s=600)) == 1
        await asyncio.sleep(0.2)
        assert await list_dead_letters(client.redis, queue, ttl_s=0.1) == []
        assert await client.redis.zcard(dead_letter_key(queue)) == 0
