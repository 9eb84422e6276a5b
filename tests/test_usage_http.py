"""``GET /v1/usage`` (docs/usage.md, "Over HTTP") against a real gateway and Redis: the
operator's admin key reads every tenant's ledger rows, a tenant key its own only, a plain key
none, and an admin key opens nothing else. The rows are written through the same EventLog the
worker ends its jobs with (no worker: the ledger's counting is tests/test_ledger.py's)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from edgeq.core.events import EventLog
from edgeq.core.ledger import LedgerScope, usage_day
from edgeq.core.protocol import DoneEvent, ErrorEvent, Timings, Usage
from edgeq.testing.processes import GatewayProcess, RedisServer

QUEUE = f"edgeq:usage-http-{uuid.uuid4().hex[:8]}"
KEYS = {
    "EDGEQ_GATEWAY_API_KEYS": "sk-plain",
    "EDGEQ_GATEWAY_TENANT_KEYS": "acme=sk-acme,zeta=sk-zeta",
    "EDGEQ_GATEWAY_ADMIN_KEYS": "sk-admin",
}


def gateway_with(redis_server: RedisServer, log: Path, **keys: str) -> GatewayProcess:
    env = {"EDGEQ_REDIS_URL": redis_server.url, "EDGEQ_QUEUE": QUEUE, "EDGEQ_MODEL": "tiny"}
    return GatewayProcess(env | keys, log).start()


@pytest.fixture(scope="module")
def gateway(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = gateway_with(redis_server, tmp_path_factory.mktemp("usage") / "gw.log", **KEYS)
    yield process
    process.stop()


@pytest.fixture(scope="module", autouse=True)
async def ledger(redis_server: RedisServer) -> None:
    """acme: two done jobs; zeta: one done and one cancelled; written today."""
    redis = Redis.from_url(redis_server.url)
    log = EventLog(redis, replay_ttl_s=60, queue=QUEUE, usage_keep_s=86_400)
    for tenant, prompt, completion in (("acme", 10, 4), ("acme", 20, 6), ("zeta", 5, 1)):
        done = DoneEvent(
            job_id=uuid.uuid4().hex, seq=0, finish_reason="stop",
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
            timings=Timings(queued_ms=3.0, ttft_ms=9.0, total_ms=20.0),
        )  # fmt: skip
        await log.append_many([done], ledger=LedgerScope(tenant, "tiny", "default"))
    cancelled = ErrorEvent(job_id=uuid.uuid4().hex, seq=0, code="cancelled", message="by you")
    await log.append_many([cancelled], ledger=LedgerScope("zeta", "tiny", "default"))
    await redis.aclose()


def get_usage(gateway: GatewayProcess, key: str | None, **params: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{gateway.base_url}/usage", headers=headers, params=params, timeout=30)


def totals(response: httpx.Response) -> dict[str, tuple[int, int, int]]:
    """Per tenant: requests, prompt tokens, completion tokens (a run across midnight splits a
    tenant's rows over two days)."""
    assert response.status_code == 200, response.text
    sums: dict[str, tuple[int, int, int]] = {}
    for row in response.json()["data"]:
        requests, prompt, completion = sums.get(row["tenant"], (0, 0, 0))
        sums[row["tenant"]] = (
            requests + row["requests"],
            prompt + row["prompt_tokens"],
            completion + row["completion_tokens"],
        )
    return sums


def test_the_admin_key_reads_every_tenants_rows(gateway: GatewayProcess) -> None:
    today = usage_day(time.time())
    answer = get_usage(gateway, "sk-admin", **{"from": "2026-01-01"})
    assert totals(answer) == {"acme": (2, 30, 10), "zeta": (2, 5, 1)}
    body = answer.json()
    assert (body["object"], body["from"], body["to"]) == ("list", "2026-01-01", today)
    [zeta] = [row for row in body["data"] if row["tenant"] == "zeta"]
    assert zeta["errors"] == {"cancelled": 1} and zeta["model"] == "tiny"
    only = get_usage(gateway, "sk-admin", tenant="zeta", **{"from": "2026-01-01"})
    assert set(totals(only)) == {"zeta"}


def test_a_tenant_key_reads_its_own_tenants_rows_only(gateway: GatewayProcess) -> None:
    assert totals(get_usage(gateway, "sk-acme", **{"from": "2026-01-01"})) == {
        "acme": (2, 30, 10)
    }
    assert set(totals(get_usage(gateway, "sk-zeta", tenant="zeta"))) <= {"zeta"}
    other = get_usage(gateway, "sk-acme", tenant="zeta")
    assert other.status_code == 403
    assert other.json()["error"]["code"] == "tenant_mismatch"


def test_a_plain_key_no_key_and_a_wrong_key_read_nothing(gateway: GatewayProcess) -> None:
    plain = get_usage(gateway, "sk-plain")
    assert plain.status_code == 403
    assert plain.json()["error"]["code"] == "admin_key_required"
    assert "EDGEQ_GATEWAY_ADMIN_KEYS" in plain.json()["error"]["message"]
    assert get_usage(gateway, None).status_code == 401
    assert get_usage(gateway, "sk-wrong").status_code == 401


def test_an_admin_key_opens_no_other_route(gateway: GatewayProcess) -> None:
    admin = {"Authorization": "Bearer sk-admin"}
    models = httpx.get(f"{gateway.base_url}/models", headers=admin, timeout=30)
    assert models.status_code == 401
    chat = httpx.post(
        f"{gateway.base_url}/chat/completions",
        headers=admin,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert chat.status_code == 401


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"from": "yesterday"}, "'yesterday' is not a UTC day"),
        ({"from": "2026-03-02", "to": "2026-03-01"}, "is before the first"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "at most 366"),
        ({"tenant": "a:b"}, "'a:b' is not a tenant name"),
    ],
)
def test_a_bad_query_is_a_400_that_names_it(
    gateway: GatewayProcess, params: dict[str, str], says: str
) -> None:
    answer = get_usage(gateway, "sk-admin", **params)
    assert answer.status_code == 400
    assert says in answer.json()["error"]["message"]


def test_with_only_admin_keys_the_job_routes_stay_open_and_usage_does_not(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    process = gateway_with(redis_server, tmp_path / "gw.log", EDGEQ_GATEWAY_ADMIN_KEYS="sk-admin")
    try:
        assert get_usage(process, None).status_code == 401
        assert get_usage(process, "sk-admin").status_code == 200
        models = httpx.get(f"{process.base_url}/models", timeout=30)
        assert models.status_code == 200
    finally:
        process.stop()
