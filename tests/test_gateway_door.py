"""The gateway's door under abuse (gateway/door.py): a real gateway process on the suite's
Redis, no worker. Nothing unauthenticated costs more than a header; every body is bounded in
size (Content-Length first, then counted) and in time, per route, before it is read, parsed or
spooled; the refusals name the true limit and its setting.

Bodies are sent over raw sockets, generated as they go (a 200 MB body is never held), so the
test measures what the gateway does with them, not what a client library does first.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest
import redis as sync_redis

from edgeq.core.keys import files_key
from edgeq.testing.processes import GatewayProcess, RedisServer

QUEUE = "edgeq:door-unserved"
MODEL = "tiny"
ACME = "sk-door-acme"
FILE_MAX = 4096
REQUEST_MAX = 2048  # EDGEQ_MAX_REQUEST_BYTES; JSON bodies may have 64 KiB more
JSON_LIMIT = REQUEST_MAX + 64 * 1024
UPLOAD_LIMIT = FILE_MAX + 64 * 1024
BODY_TIMEOUT_S = 2.0
MB = 1024 * 1024


@dataclass
class Door:
    gateway: GatewayProcess
    tmpdir: Path

    @property
    def port(self) -> int:
        return self.gateway.port

    @property
    def process(self) -> psutil.Process:
        assert self.gateway.process is not None
        return psutil.Process(self.gateway.process.pid)


@pytest.fixture(scope="module")
def door(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    tmpdir = tmp_path_factory.mktemp("gateway-tmp")
    env = {
        "EDGEQ_REDIS_URL": redis_server.url,
        "EDGEQ_QUEUE": QUEUE,
        "EDGEQ_MODEL": MODEL,
        "EDGEQ_GATEWAY_TENANT_KEYS": f"acme={ACME}",
        "EDGEQ_GATEWAY_FILE_MAX_BYTES": str(FILE_MAX),
        "EDGEQ_MAX_REQUEST_BYTES": str(REQUEST_MAX),
        "EDGEQ_GATEWAY_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "TMPDIR": str(tmpdir),  # where Starlette spools an upload
    }
    process = GatewayProcess(env, tmp_path_factory.mktemp("door") / "gateway.log").start()
    yield Door(process, tmpdir)
    process.stop()


@pytest.fixture
def acme(door: Door) -> openai.OpenAI:
    return openai.OpenAI(base_url=door.gateway.base_url, api_key=ACME, max_retries=0)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    sent: int  # body bytes the client managed to hand to its socket

    def json(self) -> dict:
        return json.loads(self.body)


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    stream = sock.makefile("rb")
    status = int(stream.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, stream.read(int(headers.get("content-length", "0")))


def _post(
    port: int,
    path: str,
    size: int,
    key: str | None,
    chunked: bool,
    content_type: str,
    stall_after: int | None,
    timeout_s: float,
) -> Answer:
    head = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Type: {content_type}"]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    block = b"x" * MB
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            while sent < size and (stall_after is None or sent < stall_after):
                part = block[: min(MB, size - sent, (stall_after or size) - sent)]
                sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
                sent += len(part)
            if chunked and sent >= size:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the gateway answered and closed: the rest is not read (as httpx,
            pass  # which then reads the answer that came before the reset)
        status, headers, body = _read_answer(sock)
    return Answer(status, headers, body, sent)


_senders = ThreadPoolExecutor(max_workers=24, thread_name_prefix="door-client")


async def post(
    port: int,
    path: str,
    size: int,
    *,
    key: str | None = None,
    chunked: bool = False,
    content_type: str = "application/json",
    stall_after: int | None = None,
    timeout_s: float = 30.0,
) -> Answer:
    """POST a body of ``size`` bytes made as it is sent (1 MB blocks), declared by
    Content-Length or sent chunked, until it is all sent or the gateway closes the connection
    (with ``stall_after``: that many bytes, then nothing); then read the gateway's answer.
    On a thread of its own, so 20 of them send at once."""
    return await asyncio.get_running_loop().run_in_executor(
        _senders, _post, port, path, size, key, chunked, content_type, stall_after, timeout_s
    )


class Usage:
    """The gateway's memory and bytes written while a block runs (its RSS sampled every
    20 ms: the peak is what a flood costs, not what is left after it)."""

    def __init__(self, process: psutil.Process) -> None:
        self.process = process
        self.peak_growth = 0
        self.written = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Usage:
        self._rss = self.process.memory_info().rss
        self._wchar = self.process.io_counters().write_chars
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            grown = self.process.memory_info().rss - self._rss
            self.peak_growth = max(self.peak_growth, grown)
            await asyncio.sleep(0.02)

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        grown = self.process.memory_info().rss - self._rss
        self.peak_growth = max(self.peak_growth, grown)
        self.written = self.process.io_counters().write_chars - self._wchar


def uploads_of(redis_server: RedisServer, tenant: str) -> int:
    connection = sync_redis.Redis.from_url(redis_server.url)
    try:
        return connection.zcard(files_key(QUEUE, tenant))
    finally:
        connection.close()


async def test_twenty_unauthenticated_200_mb_bodies_cost_the_gateway_no_memory_and_no_disk(
    door: Door,
) -> None:
    size = 200 * MB
    floods = [
        post(door.port, "/v1/files", size, content_type="multipart/form-data; boundary=x",
             chunked=n % 2 == 1)
        for n in range(10)
    ] + [
        post(door.port, "/v1/responses", size, key="sk-wrong" if n % 2 else None,
             chunked=n % 3 == 0)
        for n in range(10)
    ]  # fmt: skip
    async with Usage(door.process) as usage:
        answers = await asyncio.gather(*floods)
    print(
        f"door: 20 unauthenticated 200 MB bodies: gateway RSS +{usage.peak_growth / MB:.1f} MB "
        f"at most, {usage.written / 1024:.0f} KiB written, the most a client sent "
        f"{max(answer.sent for answer in answers) / MB:.0f} MB"
    )
    assert [answer.status for answer in answers] == [401] * 20
    for answer in answers:
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert usage.peak_growth < 50 * MB, f"RSS grew {usage.peak_growth / MB:.0f} MB"
    assert usage.written < MB, f"the gateway wrote {usage.written / MB:.1f} MB"
    assert list(door.tmpdir.iterdir()) == []
    # The connection was closed after the 401: no client got near the end of its body.
    assert max(answer.sent for answer in answers) < size


async def test_an_oversized_upload_with_a_key_is_refused_by_its_length_before_it_is_written(
    door: Door, redis_server: RedisServer
) -> None:
    before = uploads_of(redis_server, "acme")
    async with Usage(door.process) as usage:
        answer = await post(
            door.port, "/v1/files", 300 * MB, key=ACME,
            content_type="multipart/form-data; boundary=x",
        )  # fmt: skip
    assert answer.status == 413
    error = answer.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["message"] == (
        f"request body: {300 * MB} bytes, more than the {UPLOAD_LIMIT} this route takes "
        f"(EDGEQ_GATEWAY_FILE_MAX_BYTES ({FILE_MAX}) plus {64 * 1024} bytes of multipart "
        f"framing)"
    )
    assert answer.headers["connection"] == "close"
    assert usage.written < MB
    assert uploads_of(redis_server, "acme") == before


async def test_a_chunked_body_is_counted_and_refused_once_past_the_routes_limit(
    door: Door, redis_server: RedisServer
) -> None:
    before = uploads_of(redis_server, "acme")
    upload = await post(
        door.port, "/v1/files", 50 * MB, key=ACME, chunked=True,
        content_type="multipart/form-data; boundary=x",
    )  # fmt: skip
    assert upload.status == 413
    assert f"more than {UPLOAD_LIMIT} bytes" in upload.json()["error"]["message"]
    assert "EDGEQ_GATEWAY_FILE_MAX_BYTES" in upload.json()["error"]["message"]
    assert uploads_of(redis_server, "acme") == before

    for path in ("/v1/responses", "/v1/chat/completions", "/v1/batches"):
        answer = await post(door.port, path, 50 * MB, key=ACME, chunked=True)
        assert answer.status == 413, path
        message = answer.json()["error"]["message"]
        assert f"more than {JSON_LIMIT} bytes" in message
        assert f"EDGEQ_MAX_REQUEST_BYTES ({REQUEST_MAX})" in message
        assert "EDGEQ_GATEWAY_MAX_BODY_BYTES" in message
        declared = await post(door.port, path, JSON_LIMIT + 1, key=ACME)
        assert declared.status == 413
        assert declared.json()["error"]["message"].startswith(
            f"request body: {JSON_LIMIT + 1} bytes, more than the {JSON_LIMIT}"
        )


async def test_a_body_that_does_not_arrive_in_time_is_refused_with_408(door: Door) -> None:
    started = time.monotonic()
    answer = await post(
        door.port, "/v1/responses", 10_000, key=ACME, stall_after=100, timeout_s=BODY_TIMEOUT_S * 5
    )
    assert answer.status == 408
    assert "EDGEQ_GATEWAY_BODY_TIMEOUT_S" in answer.json()["error"]["message"]
    assert time.monotonic() - started >= BODY_TIMEOUT_S


def test_an_upload_is_one_file_part(acme: openai.OpenAI, door: Door) -> None:
    import httpx

    files = [
        ("file", ("a.jsonl", io.BytesIO(b"{}\n"))),
        ("file", ("b.jsonl", io.BytesIO(b"{}\n"))),
    ]
    response = httpx.post(
        f"{door.gateway.base_url}/files",
        headers={"Authorization": f"Bearer {ACME}"},
        data={"purpose": "batch"},
        files=files,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_multipart"
    assert "Too many files" in error["message"]
    assert list(door.tmpdir.iterdir()) == []


def test_a_file_over_the_limit_is_refused_with_its_true_size(acme: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        acme.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
    assert refused.value.status_code == 413
    assert refused.value.body["message"] == (  # type: ignore[index]
        f"file: 5000 bytes, more than the {FILE_MAX} allowed (EDGEQ_GATEWAY_FILE_MAX_BYTES)"
    )


def test_a_missing_key_is_a_401_with_www_authenticate_on_every_route(door: Door) -> None:
    import httpx

    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/files"),
        ("GET", "/v1/batches/batch_x"),
        ("DELETE", "/v1/responses/resp_x"),
    ):
        response = httpx.request(method, f"http://127.0.0.1:{door.port}{path}")
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"http://127.0.0.1:{door.port}/health").status_code == 200
