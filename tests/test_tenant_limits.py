"""What one tenant may keep and queue, against real gateways (two processes where a race could
pass a cap) on a queue no worker serves: OpenAI's pagination of files and batches, walked to
the end by the official SDK; the per-tenant caps on files, bytes and batches in progress,
checked and taken in one Redis step; and batches that never get another tenant's chat or
background response refused (their lines are admitted against a budget of their own)."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import redis as sync_redis
from redis.asyncio import Redis

from edgeq.core.keys import batch_lines_key, queued_by_tenant_key
from edgeq.core.scheduling import Tenancy, publish_tenancy
from edgeq.testing.processes import GatewayProcess, RedisServer

MODEL = "tiny"
KEYS = {"acme": "sk-acme", "other": "sk-other", "third": "sk-third"}
#: An iteration that runs past this many items has not ended (the SDK would page forever).
ITERATION_BOUND = 500


def chat_line(custom_id: str) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture(scope="module")
def start(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., GatewayProcess]]:
    """Start a gateway on a queue of its own (stopped at the module's end)."""
    started: list[GatewayProcess] = []
    tmp = tmp_path_factory.mktemp("tenant-limits")

    def start(name: str, **settings: str) -> GatewayProcess:
        env = {
            "EDGEQ_REDIS_URL": redis_server.url,
            "EDGEQ_QUEUE": f"edgeq:limits-{name}",
            "EDGEQ_MODEL": MODEL,
            "EDGEQ_GATEWAY_TENANT_KEYS": ",".join(f"{t}={k}" for t, k in KEYS.items()),
            **settings,
        }
        process = GatewayProcess(env, tmp / f"{name}.log").start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def sdk(gateway: GatewayProcess, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=KEYS[tenant], max_retries=0)


def upload(client: openai.OpenAI, content: bytes = b"") -> str:
    content = content or jsonl(chat_line("a"))
    return client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id


def create_batch(client: openai.OpenAI, file_id: str) -> Any:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# --- pagination ----------------------------------------------------------------------------


def test_the_sdk_pages_through_files_to_the_end_each_once_in_order(
    start: Callable[..., GatewayProcess],
) -> None:
    gateway = start("files-pages")
    client = sdk(gateway)
    uploaded = [upload(client) for _ in range(7)]
    whole = client.files.list()  # one page: every file, newest first
    assert sorted(file.id for file in whole.data) == sorted(uploaded)
    assert not whole.has_more
    newest_first = [file.id for file in whole.data]
    created = [file.created_at for file in whole.data]
    assert created == sorted(created, reverse=True)
    for limit in (1, 3, 7):
        pages = client.files.list(limit=limit)
        walked = [file.id for file in itertools.islice(pages, ITERATION_BOUND)]
        assert walked == newest_first, f"limit={limit}"
    pages = client.files.list(limit=2, order="asc")
    assert [file.id for file in itertools.islice(pages, ITERATION_BOUND)] == newest_first[::-1]
    page = client.files.list(limit=3, after=newest_first[3])
    assert [file.id for file in page.data] == newest_first[4:7] and not page.has_more
    page = client.files.list(limit=3, after=newest_first[2])
    assert [file.id for file in page.data] == newest_first[3:6] and page.has_more
    for bad in (0, -1, 10_001):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.list(limit=bad)
        assert refused.value.body["param"] == "limit", bad  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="after"):
        client.files.list(after="file-nope")
    with pytest.raises(openai.BadRequestError, match="after"):  # a cursor of another tenant
        sdk(gateway, "other").files.list(after=newest_first[0])


def test_the_sdk_pages_through_batches_to_the_end_each_once_in_order(
    start: Callable[..., GatewayProcess],
) -> None:
    client = sdk(start("batch-pages", EDGEQ_GATEWAY_BATCHES_PER_TENANT="10"))
    file_id = upload(client)
    created = [create_batch(client, file_id).id for _ in range(7)]
    newest_first = [batch.id for batch in client.batches.list(limit=100).data]
    assert sorted(newest_first) == sorted(created)
    assert newest_first == created[::-1]  # created a millisecond or more apart
    for limit in (1, 3, 7):
        pages = client.batches.list(limit=limit)
        walked = [batch.id for batch in itertools.islice(pages, ITERATION_BOUND)]
        assert walked == newest_first, f"limit={limit}"
    page = client.batches.list(limit=2, after=newest_first[4])
    assert [batch.id for batch in page.data] == newest_first[5:7] and not page.has_more
    for bad in (0, -5, 101):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.list(limit=bad)
        assert refused.value.body["param"] == "limit", bad  # type: ignore[index]
    for batch_id in created:
        client.batches.cancel(batch_id)


# --- caps, checked and taken in one step -----------------------------------------------------


def concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once (threads); each one's result or the exception it raised."""

    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except openai.APIStatusError as error:
            return error

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(outcome, calls))


def refusals(outcomes: list[Any]) -> list[openai.APIStatusError]:
    return [item for item in outcomes if isinstance(item, openai.APIStatusError)]


def test_concurrent_uploads_to_two_gateway_processes_never_pass_the_file_cap(
    start: Callable[..., GatewayProcess],
) -> None:
    gateway = start("file-race", EDGEQ_GATEWAY_WORKERS="2", EDGEQ_GATEWAY_FILES_PER_TENANT="20")
    content = jsonl(chat_line("a"))
    outcomes = concurrently([lambda: upload(sdk(gateway), content) for _ in range(40)])
    refused = refusals(outcomes)
    assert len(outcomes) - len(refused) == 20
    assert all(
        error.status_code == 400 and "EDGEQ_GATEWAY_FILES_PER_TENANT" in str(error)
        for error in refused
    ), refused
    assert len(sdk(gateway).files.list().data) == 20
    assert sdk(gateway, "other").files.list().data == []  # another tenant's cap is its own
    upload(sdk(gateway, "other"), content)


def test_concurrent_batches_never_pass_the_cap_on_batches_in_progress(
    start: Callable[..., GatewayProcess],
) -> None:
    gateway = start("batch-race", EDGEQ_GATEWAY_WORKERS="2", EDGEQ_GATEWAY_BATCHES_PER_TENANT="3")
    client = sdk(gateway)
    file_id = upload(client)
    outcomes = concurrently([lambda: create_batch(sdk(gateway), file_id) for _ in range(12)])
    refused = refusals(outcomes)
    started = [batch for batch in outcomes if not isinstance(batch, Exception)]
    assert len(started) == 3 and {batch.status for batch in started} == {"in_progress"}
    assert all(
        error.status_code == 400 and "EDGEQ_GATEWAY_BATCHES_PER_TENANT" in str(error)
        for error in refused
    ), refused
    assert len(client.batches.list().data) == 3  # a refused batch leaves no record
    client.batches.cancel(started[0].id)  # an ended batch gives its place back
    wait_until(lambda: client.batches.retrieve(started[0].id).status == "cancelled", "cancel")
    assert create_batch(client, file_id).status == "in_progress"
    with pytest.raises(openai.BadRequestError, match="EDGEQ_GATEWAY_BATCHES_PER_TENANT"):
        create_batch(client, file_id)
    for batch in client.batches.list().data:
        client.batches.cancel(batch.id)


def test_bytes_and_batch_output_count_against_the_tenant_and_usage_shows_them(
    start: Callable[..., GatewayProcess],
) -> None:
    """A tenant's files and its running batches' lines count against its byte cap, and a
    batch's output file is always written and counted; ``edgeq batch usage`` shows it all."""
    gateway = start(
        "bytes",
        EDGEQ_GATEWAY_WORKERS="2",
        EDGEQ_GATEWAY_BYTES_PER_TENANT="20000",
        EDGEQ_GATEWAY_FILES_PER_TENANT="5",
    )
    client = sdk(gateway)
    content = jsonl(*(chat_line(f"line-{n}") for n in range(40)))  # ~5.6 KB: 3 fit
    outcomes = concurrently([lambda: upload(sdk(gateway), content) for _ in range(12)])
    stored = len(outcomes) - len(refusals(outcomes))
    assert stored == 20000 // len(content)
    assert all("EDGEQ_GATEWAY_BYTES_PER_TENANT" in str(error) for error in refusals(outcomes))
    kept = [file.id for file in client.files.list().data]
    client.files.delete(kept[0])
    upload(client, content)  # room again
    client.files.delete(kept[1])
    batch = create_batch(client, kept[2])  # its lines count while it runs: no room
    with pytest.raises(openai.BadRequestError, match="EDGEQ_GATEWAY_BYTES_PER_TENANT"):
        upload(client, content)
    client.batches.cancel(batch.id)
    wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled", "cancel")
    error_file = client.batches.retrieve(batch.id).error_file_id
    assert error_file in [file.id for file in client.files.list().data]
    env = {**os.environ, **gateway.env}
    shown = subprocess.run(
        [sys.executable, "-m", "edgeq", "batch", "usage"], env=env, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    row = next(line.split() for line in shown.splitlines() if line.startswith("acme "))
    files = client.files.list().data
    assert row[1] == f"{len(files)}/5"
    assert row[2] == f"{sum(file.bytes for file in files):,}/20,000"
    assert row[3] == "0/4"


# --- admission: batches never get a chat refused --------------------------------------------


def test_batches_of_several_tenants_never_get_another_tenants_chat_refused(
    start: Callable[..., GatewayProcess], redis_server: RedisServer
) -> None:
    """Nothing serves the queue, so every admitted job stays in it. Two tenants' batches
    hold as many lines as all batches may (EDGEQ_GATEWAY_BATCH_QUEUED_MAX, more than
    EDGEQ_MAX_QUEUE here); a third tenant's background responses are still admitted until
    they themselves fill EDGEQ_MAX_QUEUE."""
    gateway = start(
        "admission",
        EDGEQ_MAX_QUEUE="5",
        EDGEQ_GATEWAY_BATCH_WINDOW="4",
        EDGEQ_GATEWAY_BATCH_QUEUED_MAX="6",
    )
    connection = sync_redis.Redis.from_url(redis_server.url)
    queue = gateway.env["EDGEQ_QUEUE"]
    try:
        batches = []
        for tenant in ("acme", "other"):
            client = sdk(gateway, tenant)
            file_id = upload(client, jsonl(*(chat_line(f"line-{n}") for n in range(8))))
            batches += [(client, create_batch(client, file_id).id) for _ in range(2)]
        wait_until(lambda: connection.zcard(queue) >= 6, "the batches queued no lines")
        assert connection.scard(batch_lines_key(queue)) == 6
        third = sdk(gateway, "third")
        accepted = [
            third.responses.create(model=MODEL, input="hi", background=True) for _ in range(5)
        ]
        assert {response.status for response in accepted} == {"queued"}
        with pytest.raises(openai.RateLimitError, match="queue"):  # its own work fills it
            third.responses.create(model=MODEL, input="hi", background=True)
        assert connection.zcard(queue) == 11  # EDGEQ_MAX_QUEUE + the batches' own 6
        for client, batch_id in batches:
            client.batches.cancel(batch_id)
        for client, batch_id in batches:
            wait_until(
                lambda c=client, b=batch_id: c.batches.retrieve(b).status == "cancelled", "cancel"
            )
        assert connection.scard(batch_lines_key(queue)) == 0
        # The batches that got no line while the others held the budget waited, unharmed.
        assert "batch_runner_failed" not in gateway.log_path.read_text()
    finally:
        connection.close()


def test_a_failed_batch_quotes_no_more_than_a_short_message_of_each_bad_line(
    start: Callable[..., GatewayProcess],
) -> None:
    """A failed batch's record is kept for the retention and counted against no cap: the
    lines' own values it quotes are cut, so 100 bad lines of 20 KB each keep it small."""
    client = sdk(start("failed-records", EDGEQ_GATEWAY_FILE_MAX_BYTES="4000000"))
    bad = [{**chat_line(f"l{n}"), "url": "/v1/" + "x" * 20_000} for n in range(100)]
    batch = create_batch(client, upload(client, jsonl(*bad)))
    assert batch.status == "failed" and batch.errors is not None
    assert len(batch.errors.data) == 100
    assert all(len(error.message or "") <= 320 for error in batch.errors.data)
    assert all("line " in (error.message or "") for error in batch.errors.data)


def test_a_tenants_own_batch_never_gets_its_chats_refused_by_its_queued_cap(
    start: Callable[..., GatewayProcess], redis_server: RedisServer
) -> None:
    """EDGEQ_TENANT_MAX_QUEUED (2 here, as a worker publishes it): the tenant's batch lines
    fill it, and its background responses are still admitted, until they fill it themselves."""
    gateway = start("own-cap", EDGEQ_GATEWAY_BATCH_WINDOW="4")
    queue = gateway.env["EDGEQ_QUEUE"]

    async def publish() -> None:
        async with Redis.from_url(redis_server.url) as redis:
            await publish_tenancy(redis, queue, Tenancy(max_queued={"acme": 2}))

    asyncio.run(publish())
    connection = sync_redis.Redis.from_url(redis_server.url)
    client = sdk(gateway)
    try:
        batch = create_batch(client, upload(client, jsonl(*(chat_line(f"l{n}") for n in range(8)))))
        by_tenant = queued_by_tenant_key(queue)
        wait_until(lambda: connection.hget(by_tenant, "acme") == b"2", "no line queued")
        accepted = [client.responses.create(model=MODEL, input="hi", background=True)
                    for _ in range(2)]  # fmt: skip
        assert {response.status for response in accepted} == {"queued"}
        with pytest.raises(openai.RateLimitError, match="EDGEQ_TENANT_MAX_QUEUED"):
            client.responses.create(model=MODEL, input="hi", background=True)
        client.batches.cancel(batch.id)
        wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled", "cancel")
    finally:
        connection.close()
