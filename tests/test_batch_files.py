"""OpenAI's Files and Batches API without an engine: the official SDK against a real gateway
on a queue no worker serves, so every accepted line waits in the queue until the batch is
cancelled or expires. What is refused, what each tenant sees, backpressure, cancel, expiry,
and the webhook events of ended batches.
(Batches that run on the engine: tests/test_batches.py.)"""

from __future__ import annotations

import base64
import io
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis as sync_redis

from edgeq.core.keys import active_batches_key
from edgeq.testing.processes import GatewayProcess, RedisServer
from helpers import WebhookReceiver

QUEUE = "edgeq:batch-unserved"
MODEL = "tiny"
ACME, OTHER = "sk-acme", "sk-other"


def chat_line(custom_id: str, content: str = "hi", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], **body},
    }


def jsonl(*lines: Any) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def start_gateway(
    redis_server: RedisServer, tmp: Any, name: str, **settings: str
) -> GatewayProcess:
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": f"{QUEUE}-{name}",
        "EDGEQ_MODEL": MODEL,
        "EDGEQ_GATEWAY_TENANT_KEYS": f"acme={ACME},other={OTHER}",
        **settings,
    }
    return GatewayProcess(env, tmp / f"{name}.log").start()


@pytest.fixture(scope="module")
def gateway(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = start_gateway(
        redis_server,
        tmp_path_factory.mktemp("batch-gateway"),
        "main",
        EDGEQ_GATEWAY_FILE_MAX_BYTES="4096",
        EDGEQ_GATEWAY_FILE_MAX_LINES="20",
        EDGEQ_GATEWAY_BATCH_WINDOW="3",
    )
    yield process
    process.stop()


@pytest.fixture
def acme(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=ACME, max_retries=0)


@pytest.fixture
def other(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=OTHER, max_retries=0)


@pytest.fixture
def queued(redis_server: RedisServer, gateway: GatewayProcess) -> Iterator[Any]:
    """How many jobs wait in the gateway's queue (nothing runs them)."""
    connection = sync_redis.Redis.from_url(redis_server.url)
    queue = gateway.env["EDGEQ_QUEUE"]
    yield lambda: connection.zcard(queue)
    connection.close()


def upload(sdk: openai.OpenAI, content: bytes, name: str = "in.jsonl") -> str:
    return sdk.files.create(file=(name, io.BytesIO(content)), purpose="batch").id


def wait_for(sdk: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def test_files_belong_to_their_tenant(acme: openai.OpenAI, other: openai.OpenAI) -> None:
    content = jsonl(chat_line("a"), chat_line("b"))
    file_id = upload(acme, content, "two.jsonl")
    got = acme.files.retrieve(file_id)
    assert (got.bytes, got.filename, got.purpose) == (len(content), "two.jsonl", "batch")
    assert acme.files.content(file_id).content == content
    assert file_id in [file.id for file in acme.files.list()]
    assert file_id not in [file.id for file in other.files.list()]
    with pytest.raises(openai.NotFoundError, match=file_id):
        other.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(file_id)
    assert acme.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(file_id)


def test_upload_limits_are_refused_naming_the_limit(acme: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as too_big:
        upload(acme, jsonl(chat_line("a", "x" * 5000)))
    assert too_big.value.status_code == 413
    assert "EDGEQ_GATEWAY_FILE_MAX_BYTES" in str(too_big.value)
    with pytest.raises(openai.BadRequestError, match="EDGEQ_GATEWAY_FILE_MAX_LINES"):
        upload(acme, jsonl(*(chat_line(str(n)) for n in range(21))))
    with pytest.raises(openai.BadRequestError, match="purpose"):
        acme.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


@pytest.mark.parametrize(
    ("bad", "code", "named"),
    [
        (b"{not json", "invalid_json_line", "not JSON"),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, "missing_custom_id",
         "custom_id"),
        (chat_line("first"), "duplicate_custom_id", "line 1"),
        ({**chat_line("u"), "url": "/v1/embeddings"}, "invalid_url", "/v1/embeddings"),
        (chat_line("t", temperature=9), "invalid_request", "temperature"),
        (chat_line("m", model="gpt-4o"), "model_not_found", "gpt-4o"),
    ],
)  # fmt: skip
def test_a_bad_line_fails_the_batch_naming_it_and_nothing_runs(
    acme: openai.OpenAI, queued: Any, redis_server: RedisServer, bad: Any, code: str, named: str
) -> None:
    file_id = upload(acme, jsonl(chat_line("first"), chat_line("second"), bad))
    batch = acme.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data
    error = batch.errors.data[0]
    assert (error.code, error.line) == (code, 3)
    assert "line 3" in (error.message or "") and named in (error.message or "")
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert queued() == 0


def test_batch_requests_refused_with_their_status(
    acme: openai.OpenAI, other: openai.OpenAI, queued: Any
) -> None:
    with pytest.raises(openai.NotFoundError, match="file-nope"):
        acme.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    file_id = upload(acme, jsonl(chat_line("a")))
    with pytest.raises(openai.NotFoundError, match=file_id):  # another tenant's file
        other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        acme.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        acme.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    assert queued() == 0


def test_cancel_a_batch_in_progress_with_backpressure(
    acme: openai.OpenAI, other: openai.OpenAI, queued: Any, redis_server: RedisServer
) -> None:
    """Nothing serves the queue: the batch keeps EDGEQ_GATEWAY_BATCH_WINDOW (3) lines queued
    and the rest in Redis; cancel dequeues them and every custom_id is in the error file."""
    ids = [f"line-{n}" for n in range(8)]
    file_id = upload(acme, jsonl(*(chat_line(custom_id) for custom_id in ids)))
    batch = acme.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "in_progress" and batch.metadata == {"job": "nightly"}
    assert batch.request_counts is not None and batch.request_counts.total == 8
    deadline = time.monotonic() + 10
    while queued() < 3:
        assert time.monotonic() < deadline, "the runner queued no lines"
        time.sleep(0.1)
    time.sleep(1.0)
    assert queued() == 3  # the window, never more
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in [item.id for item in other.batches.list()]
    assert batch.id in [item.id for item in acme.batches.list(limit=100)]
    cancelling = acme.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(acme, batch.id, {"cancelled"})
    assert done.cancelled_at is not None and done.output_file_id is None
    errors = lines_of(acme, done.error_file_id)
    assert sorted(line["custom_id"] for line in errors) == sorted(ids)
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert done.request_counts is not None and done.request_counts.failed == 8
    assert queued() == 0
    assert acme.batches.cancel(batch.id).status == "cancelled"  # again: no change
    connection = sync_redis.Redis.from_url(redis_server.url)
    try:
        assert not connection.sismember(active_batches_key(QUEUE + "-main"), batch.id)
    finally:
        connection.close()


def test_a_batch_past_its_window_expires(
    redis_server: RedisServer, tmp_path: Any, queued: Any
) -> None:
    process = start_gateway(
        redis_server, tmp_path, "expiry", EDGEQ_GATEWAY_BATCH_COMPLETION_WINDOW_S="2"
    )
    try:
        sdk = openai.OpenAI(base_url=process.base_url, api_key=ACME, max_retries=0)
        file_id = upload(sdk, jsonl(chat_line("a"), chat_line("b")))
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.expires_at is not None and batch.expires_at <= batch.created_at + 3
        expired = wait_for(sdk, batch.id, {"expired"}, timeout_s=20)
        assert expired.expired_at is not None
        errors = lines_of(sdk, expired.error_file_id)
        assert sorted(line["custom_id"] for line in errors) == ["a", "b"]
        assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    finally:
        process.stop()


def test_an_ended_batch_is_announced_by_a_signed_webhook_to_its_tenants_endpoint(
    redis_server: RedisServer, tmp_path: Any
) -> None:
    """``batch.failed`` (a bad line) and ``batch.cancelled``, once each, signed so that the
    ``openai`` SDK's ``webhooks.unwrap()`` verifies them, to the endpoint for the batches'
    tenant and not to another tenant's."""
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    receiver = WebhookReceiver()
    webhooks = [
        {"url": receiver.url("/acme"), "secret": secret, "tenant": "acme"},
        {"url": receiver.url("/other"), "secret": secret, "tenant": "other"},
    ]
    process = start_gateway(
        redis_server, tmp_path, "hooks", EDGEQ_GATEWAY_WEBHOOKS=json.dumps(webhooks)
    )
    try:
        sdk = openai.OpenAI(
            base_url=process.base_url, api_key=ACME, max_retries=0, webhook_secret=secret
        )
        failed = sdk.batches.create(
            input_file_id=upload(sdk, jsonl(chat_line("a"), b"not json")),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert failed.status == "failed"
        running = sdk.batches.create(
            input_file_id=upload(sdk, jsonl(chat_line("b"), chat_line("c"))),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        sdk.batches.cancel(running.id)
        wait_for(sdk, running.id, {"cancelled"})
        deadline = time.monotonic() + 10
        while len(receiver.delivered("/acme")) < 2:
            assert time.monotonic() < deadline, f"delivered: {receiver.delivered('/acme')}"
            time.sleep(0.1)
        time.sleep(0.5)  # a second delivery of either would arrive by now
        events = [
            sdk.webhooks.unwrap(body, headers) for headers, body in receiver.delivered("/acme")
        ]
        assert sorted((event.type, event.data.id) for event in events) == sorted(
            [("batch.failed", failed.id), ("batch.cancelled", running.id)]
        )
        assert receiver.delivered("/other") == []
    finally:
        process.stop()
        receiver.close()
