"""The usage ledger (core/ledger.py) against a real Redis: a terminal event counts its job once,
in the step that writes it; a terminal event sent again, or a second one, counts nothing; the
day's keys expire; `edgeq usage` prints the rows as JSON and CSV (no worker: the ledger is
written here through the same EventLog the worker uses)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from edgeq.core.errors import StreamClosed
from edgeq.core.events import EventLog
from edgeq.core.keys import usage_key, usage_tenants_key
from edgeq.core.ledger import LedgerScope, read_usage, rows_of, usage_day
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.testing.processes import RedisServer
from edgeq.worker.metrics import WorkerMetrics
from edgeq.worker.wire import JobPayload

KEEP_S = 7 * 86_400
#: The UTC day this module's tests began: with today's, what they read (a run across
#: midnight writes on both).
FIRST_DAY = usage_day(time.time())


def days() -> list[str]:
    return sorted({FIRST_DAY, usage_day(time.time())})


def done(job_id: str, seq: int, *, prompt: int, completion: int, continued: int | None = None
         ) -> DoneEvent:  # fmt: skip
    return DoneEvent(
        job_id=job_id,
        seq=seq,
        finish_reason="stop",
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
        timings=Timings(queued_ms=12.7, ttft_ms=30.2, total_ms=90.0),
        continued=continued,
    )


def ledger_log(redis: Redis, queue: str) -> EventLog:
    return EventLog(redis, replay_ttl_s=60, queue=queue, usage_keep_s=KEEP_S)


async def test_a_terminal_event_counts_once_in_its_step(redis: Redis, queue: str) -> None:
    log = ledger_log(redis, queue)
    scope = LedgerScope("team-a", "Qwen/Qwen3-0.6B", "interactive")
    job = f"{queue}-job"
    stream = [DeltaEvent(job_id=job, seq=0, text="hi"), done(job, 1, prompt=7, completion=3)]
    await log.append_many(stream, at_seq=True, tenant="team-a", ledger=scope)
    # The reply was lost, say: the publisher sends the same events again at their seqs.
    await log.append_many(stream, at_seq=True, tenant="team-a", ledger=scope)
    [row] = await read_usage(redis, queue, days())
    day = row.day
    assert (row.tenant, row.model, row.priority) == ("team-a", "Qwen/Qwen3-0.6B", "interactive")
    assert (row.requests, row.done, row.prompt_tokens, row.completion_tokens) == (1, 1, 7, 3)
    assert (row.queue_ms, row.ttft_ms, row.ttft_jobs, row.continued, row.errors) == (
        12, 30, 1, 0, {}
    )
    for key in (usage_key(queue, "team-a", day), usage_tenants_key(queue, day)):
        assert 0 < await redis.ttl(key) <= KEEP_S


async def test_a_second_terminal_event_is_refused_and_not_counted(
    redis: Redis, queue: str
) -> None:
    log = ledger_log(redis, queue)
    scope = LedgerScope("team-b", "tiny", "batch")
    job = f"{queue}-job"
    await log.append(ErrorEvent(job_id=job, seq=0, code="cancelled", message="by its client"))
    with pytest.raises(StreamClosed):
        await log.append_many([done(job, 1, prompt=5, completion=5)], at_seq=True, ledger=scope)
    assert await read_usage(redis, queue, days()) == []
    other = f"{queue}-other"
    await log.append_many(
        [ErrorEvent(job_id=other, seq=0, code="timeout", message="too long")],
        at_seq=True,
        ledger=scope,
    )
    await log.append_many(
        [done(f"{queue}-c", 0, prompt=4, completion=9, continued=1)], at_seq=True, ledger=scope
    )
    [row] = await read_usage(redis, queue, days(), tenants=["team-b"])
    assert (row.requests, row.done, row.continued, row.errors) == (2, 1, 1, {"timeout": 1})
    assert (row.prompt_tokens, row.completion_tokens) == (4, 9)


async def test_a_writer_without_a_ledger_or_scope_counts_nothing(
    redis: Redis, queue: str
) -> None:
    scope = LedgerScope("team-c", "tiny", "default")
    off = EventLog(redis, replay_ttl_s=60, queue=queue)  # EDGEQ_USAGE_KEEP_DAYS=0
    await off.append_many([done(f"{queue}-1", 0, prompt=1, completion=1)], ledger=scope)
    await ledger_log(redis, queue).append(done(f"{queue}-2", 0, prompt=1, completion=1))
    assert await read_usage(redis, queue, days()) == []


def test_a_model_name_with_the_separator_reads_back() -> None:
    scope = LedgerScope("t", "odd|model|name", "default")
    fields = {scope.field("requests").encode(): b"2", scope.field("error:timeout").encode(): b"1"}
    fields[b"no separator"] = b"5"  # not a ledger field: left out
    [row] = rows_of("t", "2026-12-06", fields)
    assert (row.model, row.priority, row.requests, row.errors) == (
        "odd|model|name", "default", 2, {"timeout": 1}
    )


@pytest.mark.parametrize("tenant", ["team\n", "a:b", "a|b", "", " x", "x" * 65, 7])
def test_a_payloads_odd_tenant_counts_to_the_default_tenant(tenant: object) -> None:
    payload = JobPayload({"tenant": tenant, "priority": ["batch"]}, None, 10)
    assert (payload.tenant, payload.priority) == ("default", "default")
    assert JobPayload({"tenant": "ok.team-1", "priority": "batch"}, None, 10).priority == "batch"


def usage_cli(redis_url: str, queue: str, *args: str) -> str:
    env = {**os.environ, "EDGEQ_REDIS_URL": redis_url, "EDGEQ_QUEUE": queue}
    command = [sys.executable, "-m", "edgeq", "usage", *args]
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout


async def test_the_cli_prints_json_and_csv(
    redis: Redis, redis_server: RedisServer, queue: str
) -> None:
    log = ledger_log(redis, queue)
    for tenant, number in (("team-a", 1), ("team-b", 2)):
        scope = LedgerScope(tenant, "tiny", "default")
        await log.append_many(
            [done(f"{queue}-{tenant}", 0, prompt=10 * number, completion=number)], ledger=scope
        )
    await log.append_many(
        [ErrorEvent(job_id=f"{queue}-e", seq=0, code="cancelled", message="by its client")],
        ledger=LedgerScope("team-a", "tiny", "default"),
    )
    first, last = days()[0], days()[-1]
    rows = json.loads(
        usage_cli(redis_server.url, queue, "--format", "json", "--from", first, "--to", last)
    )
    totals: dict[str, tuple[int, int]] = {}
    for row in rows:  # one row each, or two for team-a if its writes straddled midnight
        requests, prompt = totals.get(row["tenant"], (0, 0))
        totals[row["tenant"]] = (requests + row["requests"], prompt + row["prompt_tokens"])
    assert totals == {"team-a": (2, 10), "team-b": (1, 20)}
    assert [row["errors"] for row in rows if row["errors"]] == [{"cancelled": 1}]
    text = usage_cli(redis_server.url, queue, "--format", "csv", "--tenant", "team-b",
                     "--from", first, "--to", last)  # fmt: skip
    [line] = list(csv.DictReader(io.StringIO(text)))
    assert (line["tenant"], line["class"], line["completion_tokens"]) == ("team-b", "default", "2")
    table = usage_cli(redis_server.url, queue, "--from", first, "--to", last)
    assert "team-a" in table and "cancelled=1" in table


def test_the_tenant_counters_keep_their_labels_bounded() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, tenants=["support"])
    metrics.tenant_job_ended("support", "done", Usage(prompt_tokens=7, completion_tokens=3))
    metrics.tenant_job_ended("someone-else", "not-a-code", None)
    metrics.tenant_job_ended("someone-else", "timeout", None)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("edgeq:tenant_requests_total", tenant="support", outcome="done") == 1
    assert value("edgeq:tenant_tokens_total", tenant="support", kind="prompt") == 7
    assert value("edgeq:tenant_tokens_total", tenant="support", kind="completion") == 3
    assert value("edgeq:tenant_requests_total", tenant="other", outcome="other") == 1
    assert value("edgeq:tenant_requests_total", tenant="other", outcome="timeout") == 1
    assert value("edgeq:tenant_tokens_total", tenant="other", kind="prompt") is None
