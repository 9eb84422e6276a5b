"""Limits and ledger rows per API key (#42): a request's ``key_name`` is admitted against its
key's limits and its tenant's in one step, refused by whichever is spent first, settled in both
when it ends, and counted in the ledger under its key. Against a real Redis and the real
scripts, on queues no worker serves; the windows read the tenancy hash's frozen clock
(docs/limits.md). The gateway's side (keys named in its settings, 429 for a key, the name on
the job) is at the end, against a real gateway process."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import httpx
import pytest
from redis.asyncio import Redis

from edgeq.core.errors import ConfigError, RateLimited
from edgeq.core.events import EventLog
from edgeq.core.keys import job_key, key_limits_usage_key, limits_usage_key, tenancy_key
from edgeq.core.ledger import LedgerScope, read_usage, rows_of, usage_day
from edgeq.core.limits import estimate_prompt_tokens, waiting_reason
from edgeq.core.limits import read_usage as read_limits_usage
from edgeq.core.protocol import DoneEvent, Timings, Usage, record_request
from edgeq.core.scheduling import Tenancy, publish_tenancy, read_tenancy
from edgeq.core.settings import load_settings
from edgeq.gateway.settings import GatewaySettings, derived_key_name
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import GatewayProcess, RedisServer

NOON = datetime(2026, 12, 6, 12, 0, 10, tzinfo=UTC)
PROMPT = "hi"
MODEL = "tiny-model"


@pytest.fixture
async def client(redis_server: RedisServer, queue: str) -> AsyncIterator[ChatClient]:
    async with ChatClient(redis_url=redis_server.url, queue=queue) as chat_client:
        yield chat_client


async def limited(redis: Redis, queue: str, **limits: dict[str, int]) -> None:
    """The rules a worker would publish with these limits, the clock frozen at NOON."""
    tenancy = Tenancy(model=MODEL, usage_keep_s=86_400, **limits)  # type: ignore[arg-type]
    await publish_tenancy(redis, queue, tenancy)
    await redis.hset(tenancy_key(queue), "limits_clock_ms", str(int(NOON.timestamp() * 1000)))


async def minute_tokens(redis: Redis, key: str) -> int:
    return int(await redis.hget(key, "tokens") or 0)


def cost(max_tokens: int) -> int:
    """What admission reserves for PROMPT with ``max_tokens``."""
    messages = [{"role": "user", "content": PROMPT}]
    return estimate_prompt_tokens({"messages": messages}) + max_tokens


async def test_a_key_over_its_limit_is_refused_while_its_tenants_other_keys_go_on(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, key_rpm={"web": 2})
    for _ in range(2):
        await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=8)
    with pytest.raises(RateLimited) as refused:
        await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=8)
    refusal = refused.value.refusal
    assert (refusal.scope, refusal.limit, refusal.value, refusal.remaining) == (
        "key", "requests", 2, 0
    )  # fmt: skip
    assert refusal.setting == "EDGEQ_KEY_RPM"
    assert "API key web (tenant acme) is over its requests limit" in str(refused.value)
    # The same tenant's other key, and its chats sent with no key, are not held.
    await client.submit(PROMPT, tenant="acme", key_name="mobile", max_tokens=8)
    await client.submit(PROMPT, tenant="acme", max_tokens=8)
    used = await read_limits_usage(redis, queue, "web", key=True)
    assert used.requests_this_minute == 2  # the refused chat counted nowhere
    # Neither the tenant (no limits) nor the key with none is counted at all.
    assert not await redis.exists(limits_usage_key(queue, "acme"))
    assert not await redis.exists(key_limits_usage_key(queue, "mobile"))


async def test_a_chat_must_fit_both_its_keys_and_its_tenants_limits(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    one = cost(100)
    await limited(redis, queue, tpm={"acme": 3 * one}, key_tpm={"web": 2 * one})
    await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=100)
    await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=100)
    with pytest.raises(RateLimited) as by_key:
        await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=100)
    assert (by_key.value.refusal.scope, by_key.value.refusal.limit) == ("key", "tokens")
    # The key refused it before anything was counted: the tenant still has one chat left.
    assert await minute_tokens(redis, limits_usage_key(queue, "acme")) == 2 * one
    await client.submit(PROMPT, tenant="acme", key_name="batch-jobs", max_tokens=100)
    with pytest.raises(RateLimited) as by_tenant:
        await client.submit(PROMPT, tenant="acme", key_name="batch-jobs", max_tokens=100)
    refusal = by_tenant.value.refusal
    assert (refusal.scope, refusal.setting) == ("tenant", "EDGEQ_TENANT_TPM")
    assert str(by_tenant.value).startswith("tenant acme is over its tokens limit")
    assert await minute_tokens(redis, key_limits_usage_key(queue, "web")) == 2 * one


async def test_an_end_settles_in_the_keys_windows_and_the_tenants(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(
        redis, queue, tokens_per_day={"acme": 10_000}, key_tokens_per_day={"web": 5_000}
    )
    job = await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=500)
    reserved = cost(500)
    for key in (limits_usage_key(queue, "acme"), key_limits_usage_key(queue, "web")):
        assert int(await redis.hget(key, "day_tokens") or 0) == reserved
    done = DoneEvent(
        job_id=job.job_id, seq=0, finish_reason="stop",
        usage=Usage(prompt_tokens=9, completion_tokens=40),
        timings=Timings(queued_ms=1.0, ttft_ms=5.0, total_ms=30.0),
    )  # fmt: skip
    log = EventLog(redis, replay_ttl_s=60, queue=queue, usage_keep_s=86_400)
    scope = LedgerScope("acme", MODEL, "default", "web")
    await log.append_many([done], at_seq=True, tenant="acme", ledger=scope)
    await log.append_many([done], at_seq=True, tenant="acme", ledger=scope)  # sent again
    # Both scopes now hold what the chat used, once: its exact prompt and its 40 tokens.
    for key in (limits_usage_key(queue, "acme"), key_limits_usage_key(queue, "web")):
        assert int(await redis.hget(key, "day_tokens") or 0) == 9 + 40
    [row] = await read_usage(redis, queue, [usage_day(time.time())], key="web")
    assert (row.tenant, row.key, row.model) == ("acme", "web", MODEL)
    assert (row.requests, row.done) == (1, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (9, 40)


async def test_the_key_rides_on_the_job_and_a_cancel_counts_under_it(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue)  # no limits: the workers' model and ledger lifetime only
    job = await client.submit(PROMPT, tenant="acme", key_name="web", max_tokens=8)
    assert record_request(await redis.get(job_key(job.job_id)))["key_name"] == "web"
    assert await client.cancel(job.job_id)
    [row] = await read_usage(redis, queue, [usage_day(time.time())], tenants=["acme"])
    assert (row.key, row.requests, row.errors) == ("web", 1, {"cancelled": 1})
    assert await read_usage(redis, queue, [usage_day(time.time())], key="mobile") == []


async def test_ledger_fields_with_and_without_a_key_read_back_as_their_own_rows() -> None:
    fields = {
        b"tiny|default|requests": b"3",
        b"key=web|tiny|default|requests": b"2",
        b"key=web|odd|model|batch|done": b"1",  # a model name may hold '|'
    }
    rows = rows_of("acme", "2026-12-06", fields)
    assert [(row.key, row.model, row.priority) for row in rows] == [
        (None, "tiny", "default"), ("web", "odd|model", "batch"), ("web", "tiny", "default"),
    ]  # fmt: skip
    assert [row.requests for row in rows] == [3, 0, 2]


async def test_a_batch_held_by_its_keys_budget_says_so(
    redis: Redis, queue: str, client: ChatClient
) -> None:
    await limited(redis, queue, key_tokens_per_day={"nightly-job": cost(64)})
    await client.submit(PROMPT, tenant="acme", key_name="nightly-job", max_tokens=64)
    with pytest.raises(RateLimited) as refused:
        await client.submit(PROMPT, tenant="acme", key_name="nightly-job", max_tokens=64)
    reason = waiting_reason("acme", refused.value.refusal, "nightly-job")
    assert reason.startswith(
        "lines wait: API key nightly-job (tenant acme)'s tokens per day limit "
        f"({cost(64)}, EDGEQ_KEY_TOKENS_PER_DAY) is spent until "
    )


async def test_key_limits_published_by_workers_read_back(redis: Redis, queue: str) -> None:
    await limited(redis, queue, key_tpm={"web": 900}, tpm={"acme": 1000})
    tenancy = await read_tenancy(redis, queue)
    assert tenancy is not None
    assert (tenancy.key_tpm, tenancy.tpm, tenancy.key_rpm) == ({"web": 900}, {"acme": 1000}, {})


# --- the gateway -------------------------------------------------------------------------------


def test_tenant_keys_are_named_by_the_operator_or_by_their_hash() -> None:
    settings = GatewaySettings(
        gateway_api_keys="sk-plain", gateway_tenant_keys="acme:web=sk-web,acme=sk-other"
    )
    names = {job_key.key: (job_key.tenant, job_key.name) for job_key in settings.job_keys}
    assert names == {
        "sk-plain": (None, derived_key_name("sk-plain")),
        "sk-web": ("acme", "web"),
        "sk-other": ("acme", derived_key_name("sk-other")),
    }
    assert derived_key_name("sk-other").startswith("key-")


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ("acme:web=sk-1,zeta:web=sk-2", "the key name 'web' is given to two keys"),
        ("acme:web=sk-1,acme:app=sk-1", "one key is named both 'web' and 'app'"),
        ("acme:=sk-1", "a ':' with no key name after it"),
        ("acme:w b=sk-1", "is not a tenant name, or tenant:name"),
    ],
)
def test_a_key_name_that_cannot_stand_for_one_key_is_refused(entries: str, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(GatewaySettings, gateway_tenant_keys=entries)
    message = str(refused.value)
    assert "EDGEQ_GATEWAY_TENANT_KEYS" in message and problem in message
    assert "sk-1" not in message  # the keys are never echoed


GATEWAY_QUEUE = f"edgeq:key-limits-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def gateway(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": GATEWAY_QUEUE,
        "EDGEQ_MODEL": "tiny",
        "EDGEQ_GATEWAY_TENANT_KEYS": "acme:web=sk-web,acme:app=sk-app",
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("keys") / "gw.log").start()
    yield process
    process.stop()


async def test_the_gateway_answers_429_for_a_spent_key_and_names_the_key_on_the_job(
    redis: Redis, gateway: GatewayProcess
) -> None:
    await limited(redis, GATEWAY_QUEUE, key_rpm={"web": 1})
    body = {"model": "tiny", "input": "hi", "background": True, "max_output_tokens": 8}
    web, app = ({"Authorization": f"Bearer {key}"} for key in ("sk-web", "sk-app"))
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        first = await http.post("/responses", json=body, headers=web)
        assert first.status_code == 200, first.text
        assert await key_name_of(redis, first) == "web"
        spent = await http.post("/responses", json=body, headers=web)
        other = await http.post("/responses", json=body, headers=app)
    assert spent.status_code == 429, spent.text
    error = spent.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert "API key web (tenant acme)" in error["message"]
    assert "EDGEQ_KEY_RPM" in error["message"]
    assert spent.headers["x-ratelimit-limit-requests"] == "1"
    assert spent.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(spent.headers["retry-after"]) >= 1
    assert other.status_code == 200, other.text  # the tenant's other key is not held
    assert await key_name_of(redis, other) == "app"


async def key_name_of(redis: Redis, response: httpx.Response) -> str:
    """The key name on the job a gateway response started."""
    payload = await redis.get(job_key(response.headers["x-edgeq-job-id"]))
    return str(record_request(payload)["key_name"])
