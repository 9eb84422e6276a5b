"""The dead-letter set and ``edgeq dead-letter`` against a real Redis (no engine): a job
quarantined by its hand-over is listed without its prompt, shown, sent again as a new job and
dropped; the same request is refused at the door meanwhile (its fingerprint,
core/fingerprint.py), until the refusal runs out or an operator lifts it. The engine's side (a
request that kills two engines) is tests/test_poison.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import pytest

from edgeq.core.dead_letter import list_dead_letters
from edgeq.core.errors import InvalidRequest, PoisonRefused
from edgeq.core.events import read_events
from edgeq.core.fingerprint import record_fingerprint, request_fingerprint
from edgeq.core.keys import dead_letter_key, job_key, leases_key, poison_refusal_key
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
#: The quarantine's EDGEQ_POISON_REFUSE_S in these tests.
REFUSE_S = 600.0


async def quarantined_job(
    client: ChatClient, *, tenant: str = "acme", refuse_s: float = REFUSE_S, seed: int = 1
) -> str:
    """A job as two dead engines leave it: enqueued (no worker here), running at two engine
    failures, its lease run out; then handed over, which quarantines it (and refuses the same
    request at the door for ``refuse_s``)."""
    job = await client.submit(PROMPT, tenant=tenant, max_tokens=8, seed=seed)
    await job.aclose()
    queue = client.settings.queue
    await client.redis.zadd(leases_key(queue), {job.job_id: 1})  # expired in 1970
    for _ in range(POISON_AFTER_ENGINE_FAILURES):
        await mark_engine_failures(client.redis, [job.job_id])
    if (await client.redis.info("server"))["uptime_in_seconds"] < 1:
        await asyncio.sleep(1.0)  # leases run out only once Redis is up a lease TTL
    outcome = await hand_over(
        client.redis, client.events, job.job_id, queue=queue, max_continuations=2,
        deadline_s=30, lease_ttl_s=0.2, dead_letter_ttl_s=600, poison_refuse_s=refuse_s,
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
        other = await quarantined_job(client, tenant="globex", seed=2)
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


# --- the same request refused at the door ------------------------------------------------------


async def test_the_same_request_is_refused_at_the_door_until_an_operator_drops_it(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        poison = await quarantined_job(client)
        # The same request, whoever sends it and in whichever class: refused, nothing enqueued.
        for tenant, priority in (("acme", None), ("globex", "interactive")):
            with pytest.raises(PoisonRefused) as refused:
                await client.submit(PROMPT, tenant=tenant, max_tokens=8, seed=1,
                                    priority=priority)  # fmt: skip
            assert isinstance(refused.value, InvalidRequest)  # not worth retrying unchanged
            assert refused.value.job_id == poison
            assert 0 < refused.value.left_s <= REFUSE_S
            message = str(refused.value)
            assert "quarantined as a poison job" in message
            assert f"dead-letter drop {poison}" in message
            assert PROMPT not in message
        assert await client.redis.zcard(queue) == 0  # the quarantined job left it too
        # What the engine would compute differently is another request: accepted.
        other = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=2)
        await other.aclose()

        show = await asyncio.to_thread(edgeq, redis_server, queue, "show", poison)
        shown = json.loads(show.stdout)
        assert shown["fingerprint"] == refused.value.fingerprint
        assert 0 < shown["refused_at_the_door_s"] <= REFUSE_S

        dropped = await asyncio.to_thread(edgeq, redis_server, queue, "drop", poison)
        assert dropped.returncode == EXIT_OK, dropped.stderr
        again = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1)
        await again.aclose()
        assert await client.redis.zscore(queue, again.job_id) is not None


async def test_the_refusal_ends_after_edgeq_poison_refuse_s(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        await quarantined_job(client, refuse_s=0.5)
        with pytest.raises(PoisonRefused):
            await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1)
        deadline = time.monotonic() + 30
        while True:  # the key's TTL runs out on Redis's clock: polled, not slept on
            try:
                job = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1)
            except PoisonRefused:
                assert time.monotonic() < deadline, "still refused 30 s after a 0.5 s refusal"
                await asyncio.sleep(0.1)
            else:
                await job.aclose()
                break


async def test_nothing_is_refused_with_edgeq_poison_refuse_s_0(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        await quarantined_job(client, refuse_s=0)  # the quarantine records nothing
        assert not [key async for key in client.redis.scan_iter(match=f"{queue}:poison-*")]
        job = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1)
        await job.aclose()
    async with ChatClient(redis_url=redis_server.url, queue=queue, poison_refuse_s=0) as client:
        poison = await quarantined_job(client)  # recorded, but this client does not check
        job = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1)
        await job.aclose()
        fingerprint = record_fingerprint(await client.redis.get(job_key(job.job_id)))
        assert fingerprint is not None
        assert await client.redis.get(poison_refusal_key(queue, fingerprint)) == poison.encode()


async def test_the_producer_and_the_quarantine_compute_one_fingerprint(
    redis_server: RedisServer, queue: str
) -> None:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as client:
        job = await client.submit(PROMPT, tenant="acme", max_tokens=8, seed=1,
                                  response_format={"type": "json_object"})  # fmt: skip
        await job.aclose()
        stored = await client.redis.get(job_key(job.job_id))
    request = json.loads(stored)["a"][0]
    assert record_fingerprint(stored) == request_fingerprint(request)
    # Delivery fields and nulls are left out; what the engine computes from is in.
    base = {"messages": [{"role": "user", "content": "hi"}], "seed": 1}
    same = {**base, "tenant": "x", "priority": "batch", "stream": False, "top_p": None,
            "on_worker_lost": "fail", "return_reasoning": True}  # fmt: skip
    assert request_fingerprint(same) == request_fingerprint(base)
    for changed in ({"seed": 2}, {"max_tokens": 9}, {"adapter": "a"},
                    {"response_format": {"type": "json_object"}}):  # fmt: skip
        assert request_fingerprint(base | changed) != request_fingerprint(base)
    # The recipe as docs/wire-contract.md writes it for other languages.
    import hashlib

    canonical = '{"messages":[{"content":"hi","role":"user"}],"seed":1}'
    assert request_fingerprint(same) == hashlib.sha256(canonical.encode()).hexdigest()
