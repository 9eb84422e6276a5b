"""Tenants' rate limits and token budgets at the door (docs/limits.md), against a real Redis and
the real enqueue and settlement scripts, on queues no worker serves: the windows are driven by
the tenancy hash's frozen clock (``limits_clock_ms``), so nothing here depends on when it runs.
The gateway's 429 is checked through the official openai SDK."""

from __future__ import annotations

import asyncio
import calendar
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from edgeq.bench import limits_overhead
from edgeq.core.errors import QueueFull, RateLimited
from edgeq.core.events import EventLog
from edgeq.core.keys import (
    batch_key,
    job_key,
    limits_usage_key,
    reservation_key,
    tenancy_key,
)
from edgeq.core.limits import estimate_prompt_tokens, read_usage, set_limit
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.core.scheduling import Tenancy, publish_tenancy, read_tenancy
from edgeq.producer.client import ChatClient
from edgeq.producer.queue import Enqueued, JobQueue
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from edgeq.worker.settings import WorkerSettings

#: 2026-12-06 12:00:10 UTC: 50 s left in its minute.
NOON = datetime(2026, 12, 6, 12, 0, 10, tzinfo=UTC)
PROMPT = "hi"


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


async def freeze(redis: Redis, queue: str, moment: datetime) -> None:
    """Set the clock the limits' windows read (lua/limits.lua)."""
    await redis.hset(tenancy_key(queue), "limits_clock_ms", str(ms(moment)))


@pytest.fixture
async def client(redis_server: RedisServer, queue: str) -> AsyncIterator[ChatClient]:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as chat_client:
        yield chat_client


async def limit(redis: Redis, queue: str, moment: datetime = NOON, **limits: Any) -> None:
    await publish_tenancy(redis, queue, Tenancy(**limits))
    await freeze(redis, queue, moment)


async def used(redis: Redis, queue: str, tenant: str) -> dict[str, int]:
    raw = await redis.hgetall(limits_usage_key(queue, tenant))
    return {key.decode(): int(value) for key, value in raw.items()}


def prompt_cost() -> int:
    return estimate_prompt_tokens({"messages": [{"role": "user", "content": PROMPT}]})


def done(job_id: str, seq: int, *, prompt: int, completion: int) -> DoneEvent:
    return DoneEvent(
        job_id=job_id, seq=seq, finish_reason="stop",
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
        timings=Timings(queued_ms=1.0, total_ms=2.0),
    )  # fmt: skip


async def end(
    redis: Redis, queue: str, events: list[DeltaEvent | DoneEvent | ErrorEvent], tenant: str
) -> None:
    """Write a job's events as its worker does (at their seqs): the terminal one settles."""
    log = EventLog(redis, replay_ttl_s=60, queue=queue)
    await log.append_many(events, at_seq=True, tenant=tenant)


async def test_requests_per_minute_refuse_with_what_is_left_and_reset_when_the_minute_turns(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, rpm={"acme": 2})
    for _ in range(2):
        await client.submit(PROMPT, tenant="acme", max_tokens=4)
    with pytest.raises(RateLimited) as refused:
        await client.submit(PROMPT, tenant="acme", max_tokens=4)
    refusal = refused.value.refusal
    assert (refusal.limit, refusal.value, refusal.remaining) == ("requests", 2, 0)
    assert refusal.reset_s == 50 and refused.value.retry_after_s == 50
    assert (refusal.requests_limit, refusal.requests_remaining, refusal.tokens_limit) == (2, 0, 0)
    assert isinstance(refused.value, QueueFull)  # what callers retrying a full queue catch
    assert "EDGEQ_TENANT_RPM" in str(refused.value)
    assert await redis.zcard(queue) == 2  # the refused chat was not enqueued

    await freeze(redis, queue, NOON + timedelta(seconds=50))  # the next minute
    await client.submit(PROMPT, tenant="acme", max_tokens=4)
    assert (await used(redis, queue, "acme"))["requests"] == 1


async def test_a_limited_tenant_leaves_the_others_unaffected(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, rpm={"acme": 1}, tpm={"acme": 10_000})
    await client.submit(PROMPT, tenant="acme", max_tokens=4)
    with pytest.raises(RateLimited):
        await client.submit(PROMPT, tenant="acme", max_tokens=4)
    for _ in range(20):
        await client.submit(PROMPT, tenant="other", max_tokens=4)
    assert await used(redis, queue, "other") == {}  # an unlimited tenant is not even counted
    assert not await redis.exists(limits_usage_key(queue, "other"))


async def test_tokens_per_minute_reserve_max_tokens_and_the_settlement_gives_back_once(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, tpm={"acme": 1000})
    cost = prompt_cost() + 600
    job = await client.submit(PROMPT, tenant="acme", max_tokens=600)
    assert (await used(redis, queue, "acme"))["tokens"] == cost
    with pytest.raises(RateLimited) as refused:  # another 600 would pass 1000
        await client.submit(PROMPT, tenant="acme", max_tokens=600)
    assert refused.value.refusal.limit == "tokens"
    assert refused.value.refusal.remaining == 1000 - cost

    # The job answered with 10 tokens on a 5-token prompt: the rest comes back, once, in the
    # step that writes its done event.
    answered = [DeltaEvent(job_id=job.job_id, seq=0, text="hi"),
                done(job.job_id, 1, prompt=5, completion=10)]  # fmt: skip
    await end(redis, queue, answered, "acme")
    assert (await used(redis, queue, "acme"))["tokens"] == 15
    assert (await used(redis, queue, "acme"))["day_tokens"] == 15
    assert not await redis.exists(reservation_key(queue, job.job_id))
    # The same write sent again (its reply was lost) settles nothing more.
    await end(redis, queue, answered, "acme")
    assert (await used(redis, queue, "acme"))["tokens"] == 15
    await client.submit(PROMPT, tenant="acme", max_tokens=600)  # fits again


async def test_a_settlement_names_the_tenant_it_settles_for(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    """A job whose request names another tenant than the one it was admitted for (a producer
    in another language may pass both) gives nothing back to the other tenant."""
    await limit(redis, queue, tpm={"acme": 1000, "other": 1000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=500)
    await client.submit(PROMPT, tenant="other", max_tokens=500)
    await end(redis, queue, [done(job.job_id, 0, prompt=0, completion=0)], "other")
    assert not await redis.exists(reservation_key(queue, job.job_id))
    assert (await used(redis, queue, "other"))["tokens"] == prompt_cost() + 500
    assert (await used(redis, queue, "acme"))["tokens"] == prompt_cost() + 500


async def test_a_chat_without_max_tokens_reserves_the_workers_max_tokens(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, tpm={"acme": 10_000}, max_tokens=300)
    await client.submit(PROMPT, tenant="acme")
    assert (await used(redis, queue, "acme"))["tokens"] == prompt_cost() + 300


async def test_a_settlement_in_a_later_minute_leaves_that_minute_alone(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, tpm={"acme": 1000}, tokens_per_day={"acme": 100_000})
    job = await client.submit(PROMPT, tenant="acme", max_tokens=500)
    await freeze(redis, queue, NOON + timedelta(minutes=1))
    later = await client.submit(PROMPT, tenant="acme", max_tokens=100)
    assert later.job_id
    # It ended in the next minute with 20 of its 500 tokens: the day gets 480 back.
    await end(redis, queue, [DeltaEvent(job_id=job.job_id, seq=0, text="hi"),
                             done(job.job_id, 1, prompt=prompt_cost(), completion=20)],
              "acme")  # fmt: skip
    counts = await used(redis, queue, "acme")
    assert counts["tokens"] == prompt_cost() + 100  # this minute's own chat only
    assert counts["day_tokens"] == 2 * prompt_cost() + 100 + 20


async def test_the_day_budget_refuses_until_the_utc_day_turns(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, tokens_per_day={"acme": 1000})
    await client.submit(PROMPT, tenant="acme", max_tokens=600)
    with pytest.raises(RateLimited) as refused:
        await client.submit(PROMPT, tenant="acme", max_tokens=600)
    refusal = refused.value.refusal
    assert refusal.limit == "tokens_per_day"
    assert refusal.reset_s == 12 * 3600 - 10  # until midnight UTC
    assert refusal.requests_limit == refusal.tokens_limit == 0  # no minute limits set
    await freeze(redis, queue, datetime(2026, 12, 7, 0, 0, tzinfo=UTC))
    await client.submit(PROMPT, tenant="acme", max_tokens=600)


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 12, 31, 23, 59, 30, tzinfo=UTC),
        datetime(2024, 2, 10, 8, 0, tzinfo=UTC),  # a leap February
        datetime(2023, 2, 28, 23, 0, tzinfo=UTC),
        datetime(2100, 2, 1, 0, 0, tzinfo=UTC),  # not a leap year
        datetime(1999, 4, 30, 12, 0, tzinfo=UTC),
    ],
)
async def test_the_month_budget_resets_when_the_utc_calendar_month_ends(
    redis: Redis, queue: str, client: ChatClient, moment: datetime
) -> None:
    await limit(redis, queue, moment, tokens_per_month={"acme": 1000})
    await client.submit(PROMPT, tenant="acme", max_tokens=900)
    with pytest.raises(RateLimited) as refused:
        await client.submit(PROMPT, tenant="acme", max_tokens=900)
    days = calendar.monthrange(moment.year, moment.month)[1]
    month_end = moment.replace(day=1, hour=0, minute=0, second=0) + timedelta(days=days)
    assert refused.value.refusal.limit == "tokens_per_month"
    assert refused.value.refusal.reset_s == (month_end - moment).total_seconds()
    await freeze(redis, queue, month_end)
    await client.submit(PROMPT, tenant="acme", max_tokens=900)


async def test_concurrent_submits_never_pass_the_limit(
    redis: Redis, redis_server: RedisServer, queue: str
) -> None:
    await limit(redis, queue, rpm={"acme": 25}, tpm={"acme": 1_000_000})
    clients = [ChatClient(redis_url=redis_server.url, queue=queue) for _ in range(4)]
    try:
        # 4 clients (connections) × 30 submits each, all at once (each client batches its own).
        results = await asyncio.gather(
            *(
                client.submit(PROMPT, tenant="acme", max_tokens=4)
                for client in clients
                for _ in range(30)
            ),
            return_exceptions=True,
        )
    finally:
        for client in clients:
            await client.aclose()
    refused = [result for result in results if isinstance(result, RateLimited)]
    assert len(refused) == 120 - 25
    assert all(not isinstance(r, BaseException) or isinstance(r, RateLimited) for r in results)
    assert await redis.zcard(queue) == 25
    assert (await used(redis, queue, "acme"))["requests"] == 25


async def test_a_caller_without_the_limits_keys_is_refused_for_a_limited_tenant(
    redis: Redis, queue: str
) -> None:
    """A producer in another language that enqueues with the old key list cannot pass around
    its tenant's limits (docs/wire-contract.md)."""
    await limit(redis, queue, rpm={"acme": 5})
    jobs = JobQueue(redis, queue)
    keys = [queue, job_key("j1"), *jobs._scheduling_keys, jobs._batch_lines_key]
    args = ["{}", 60_000, 0, "j1", "wake", 1, "acme"]
    assert (await jobs._enqueue(keys, args))[0] == Enqueued.UNLIMITED_CALLER
    assert (await jobs._enqueue(keys, [*args[:6], "other"]))[0] == Enqueued.ACCEPTED


async def test_limits_are_published_and_changed_at_run_time(redis: Redis, queue: str) -> None:
    await publish_tenancy(redis, queue, Tenancy(rpm={"acme": 5}, tokens_per_month={"b": 9}))
    await set_limit(redis, queue, "acme", "tpm", 700)
    await set_limit(redis, queue, "acme", "rpm", 0)  # 0: no limit
    tenancy = await read_tenancy(redis, queue)
    assert tenancy is not None
    assert (tenancy.rpm, tenancy.tpm, tenancy.tokens_per_month) == ({}, {"acme": 700}, {"b": 9})


# --- the gateway ---------------------------------------------------------------------------


@pytest.fixture
def gateway(redis_server: RedisServer, queue: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": queue,
        "EDGEQ_MODEL": "tiny",
        "EDGEQ_GATEWAY_TENANT_KEYS": "acme=sk-acme",
    }
    process = GatewayProcess(env, tmp_path / "gateway.log").start()
    yield process
    process.stop()


async def test_the_gateway_answers_429_with_openais_rate_limit_headers(
    redis: Redis, queue: str, client: ChatClient, gateway: GatewayProcess
) -> None:
    await limit(redis, queue, rpm={"acme": 1}, tpm={"acme": 5000})
    await client.submit(PROMPT, tenant="acme", max_tokens=100)  # the minute's one request
    sdk = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="sk-acme", max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=10
        )
    await sdk.close()
    error = refused.value
    headers = error.response.headers
    assert error.status_code == 429
    assert headers["retry-after"] == "50"
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "50s"
    assert headers["x-ratelimit-limit-tokens"] == "5000"
    assert headers["x-ratelimit-remaining-tokens"] == str(5000 - prompt_cost() - 100)
    assert headers["x-ratelimit-reset-tokens"] == "50s"
    body: Any = error.body
    assert body["code"] == "rate_limit_exceeded" and body["type"] == "rate_limit_error"
    assert "EDGEQ_TENANT_RPM" in body["message"]



def edgeq(redis_server: RedisServer, queue: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeq", *argv, "--redis-url", redis_server.url, "--queue", queue],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_the_cli_sets_limits_the_next_submit_obeys_and_shows_the_usage(
    redis: Redis, redis_server: RedisServer, queue: str, client: ChatClient
) -> None:
    await limit(redis, queue, tpm={"other": 50_000})
    done = edgeq(redis_server, queue, "tenants", "limits", "set", "acme", "--rpm", "1",
                 "--tokens-per-day", "9000")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "acme" in done.stdout and "rpm 1" in done.stdout
    await client.submit(PROMPT, tenant="acme", max_tokens=40)
    with pytest.raises(RateLimited):
        await client.submit(PROMPT, tenant="acme", max_tokens=40)
    shown = edgeq(redis_server, queue, "tenants", "limits", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["acme"]["limits"] == {
        "rpm": 1, "tpm": None, "tokens_per_day": 9000, "tokens_per_month": None,
    }  # fmt: skip
    assert report["acme"]["used"] == {
        "requests_this_minute": 1,
        "tokens_this_minute": prompt_cost() + 40,
        "tokens_today": prompt_cost() + 40,
        "tokens_this_month": prompt_cost() + 40,
    }
    assert report["other"]["used"]["tokens_today"] == 0
    await freeze(redis, queue, NOON + timedelta(days=1))  # a new day: the counts read 0
    assert (await read_usage(redis, queue, "acme")).tokens_today == 0
    refused = edgeq(redis_server, queue, "tenants", "limits", "set", "acme")
    assert refused.returncode != 0 and "name one at least" in refused.stderr


async def test_a_batch_whose_tenant_spent_its_day_waits_and_says_so(
    redis: Redis, redis_server: RedisServer, queue: str, gateway: GatewayProcess
) -> None:
    """Its lines are not failed: they wait for the next UTC day (or a budget raised), and
    ``edgeq batch status`` says why meanwhile."""
    await limit(redis, queue, tokens_per_day={"acme": 100})
    sdk = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="sk-acme", max_retries=0)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 500}}  # fmt: skip
    uploaded = await sdk.files.create(
        file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch"
    )
    batch = await sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 30
    while not await redis.hget(batch_key(queue, batch.id), "waiting"):
        assert time.monotonic() < deadline, "the batch never said it waits"
        await asyncio.sleep(0.05)
    status = edgeq(redis_server, queue, "batch", "status", batch.id, "--tenant", "acme")
    assert status.returncode == 0, status.stderr
    assert "in_progress: 0 completed, 0 failed of 1" in status.stdout
    assert "tokens per day limit (100, EDGEQ_TENANT_TOKENS_PER_DAY)" in status.stdout
    assert await redis.zcard(queue) == 0

    await set_limit(redis, queue, "acme", "tokens_per_day", 10_000)  # raised at run time
    deadline = time.monotonic() + 30
    while await redis.zcard(queue) == 0:  # tried again within LIMITS_RETRY_S
        assert time.monotonic() < deadline, "the line never went on"
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 30
    while await redis.hget(batch_key(queue, batch.id), "waiting"):
        assert time.monotonic() < deadline, "the batch still says it waits"
        await asyncio.sleep(0.05)
    assert (await sdk.batches.retrieve(batch.id)).request_counts.failed == 0  # type: ignore[union-attr]
    await sdk.close()


# --- a real worker ---------------------------------------------------------------------------


@pytest.mark.engine
async def test_a_real_worker_settles_each_chat_with_what_it_used(
    redis: Redis, worker: WorkerProcess
) -> None:
    """The shared worker's terminal step settles the reservation: the day's count ends as the
    engine's exact prompt plus the answer's tokens, not the estimate plus max_tokens. It is
    settled in the step that writes the done event, so once the result is read it is."""
    queue, tenant = worker.env["EDGEQ_QUEUE"], f"settled-{uuid.uuid4().hex[:6]}"
    await set_limit(redis, queue, tenant, "tokens_per_day", 1_000_000)
    await freeze(redis, queue, NOON)  # only limited tenants read it: this test's own
    try:
        async with ChatClient(redis_url=worker.env["EDGEQ_REDIS_URL"], queue=queue) as client:
            job = await client.submit(PROMPT, tenant=tenant, max_tokens=200)
            assert (await used(redis, queue, tenant))["day_tokens"] == prompt_cost() + 200
            result = await job.result()
        assert not await redis.exists(reservation_key(queue, job.job_id))
        spent = result.usage.prompt_tokens + result.usage.completion_tokens
        assert (await used(redis, queue, tenant))["day_tokens"] == spent
    finally:
        await set_limit(redis, queue, tenant, "tokens_per_day", 0)
        await redis.hdel(tenancy_key(queue), "limits_clock_ms")


async def test_the_limits_bench_measures_every_mode_on_a_redis_of_its_own() -> None:
    results = await limits_overhead.run(rounds=1, jobs=20, burst=10)
    assert set(results) == {"off", "on", "key"}
    assert all(lone > 0 and rate > 0 for rows in results.values() for lone, rate in rows)


def test_the_workers_settings_become_the_published_limits(
    monkeypatch: pytest.MonkeyPatch, clean_edgeq_env: None
) -> None:
    monkeypatch.setenv("EDGEQ_TENANT_RPM", "support=600, team-ml=120")
    monkeypatch.setenv("EDGEQ_TENANT_TOKENS_PER_DAY", "nightly=5000000")
    monkeypatch.setenv("EDGEQ_MAX_TOKENS", "64")
    tenancy = WorkerSettings().tenancy
    assert tenancy.rpm == {"support": 600, "team-ml": 120}
    assert tenancy.tokens_per_day == {"nightly": 5_000_000}
    assert tenancy.tpm == tenancy.tokens_per_month == {}
    assert tenancy.max_tokens == 64
    assert tenancy.key_rpm == {}
    assert {"support", "team-ml", "nightly"} <= set(tenancy.named_tenants)
    for bad in ("support=1.5", "support=0", "support"):
        monkeypatch.setenv("EDGEQ_TENANT_TPM", bad)
        with pytest.raises(ValidationError, match=r"EDGEQ_TENANT_TPM|tenant=number"):
            WorkerSettings()


def test_the_workers_key_limits_become_the_published_key_limits(
    monkeypatch: pytest.MonkeyPatch, clean_edgeq_env: None
) -> None:
    monkeypatch.setenv("EDGEQ_KEY_TPM", "web=300000,key-0123456789ab=5000")
    monkeypatch.setenv("EDGEQ_KEY_TOKENS_PER_MONTH", "web=9000000")
    tenancy = WorkerSettings().tenancy
    assert tenancy.key_tpm == {"web": 300_000, "key-0123456789ab": 5000}
    assert tenancy.key_tokens_per_month == {"web": 9_000_000}
    assert tenancy.tpm == tenancy.key_rpm == {}
    monkeypatch.setenv("EDGEQ_KEY_RPM", "web=0")
    with pytest.raises(ValidationError, match="EDGEQ_KEY_RPM: web's value is not a count > 0"):
        WorkerSettings()
