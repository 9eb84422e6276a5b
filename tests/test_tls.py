"""rediss:// for real: a Redis that speaks only TLS, with a CA and certificate made for the
run, and every part of edgeq verifying the chain and the host name against that CA."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from edgeq import ChatClient, RedisUnavailable
from edgeq.core.protocol import DeltaEvent, DoneEvent
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from edgeq.testing.tls import TlsFiles, make_ca, make_tls_files, rediss_url
from helpers import EDGEQ, engine_env, ready_worker

pytestmark = pytest.mark.engine

QUEUE = "edgeq:test-tls"
EXIT_UNAVAILABLE = 69


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def wrong_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    certificate, _ = make_ca(tmp_path_factory.mktemp("wrong-ca"), "some other CA")
    return certificate


@pytest.fixture(scope="module")
def tls_redis(tls_files: TlsFiles) -> Iterator[RedisServer]:
    server = RedisServer(tls=tls_files).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_worker(
    tiny_model: Path, tls_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    env = engine_env(tiny_model, tls_redis.url, QUEUE)
    with ready_worker(env, tmp_path_factory.mktemp("tls-worker") / "worker.log") as process:
        yield process


@pytest.fixture
async def tls_client(tls_worker: WorkerProcess) -> AsyncIterator[ChatClient]:
    async with ChatClient(redis_url=tls_worker.env["EDGEQ_REDIS_URL"], queue=QUEUE) as client:
        yield client


def test_the_url_verifies_chain_and_host_name(tls_redis: RedisServer, tls_files: TlsFiles) -> None:
    assert tls_redis.url.startswith("rediss://127.0.0.1:")
    assert "ssl_cert_reqs=required" in tls_redis.url and "ssl_check_hostname=true" in tls_redis.url
    assert f"ssl_ca_certs={tls_files.ca}" in tls_redis.url


async def test_a_chat_streams_over_verified_tls(tls_client: ChatClient) -> None:
    job = await tls_client.submit("Hello over TLS", max_tokens=16, seed=1)
    events = [event async for event in job.stream()]
    assert isinstance(events[-1], DoneEvent)
    assert [event.seq for event in events] == list(range(len(events)))
    assert any(isinstance(event, DeltaEvent) and event.text for event in events)


def test_edgeq_status_reads_over_tls(tls_worker: WorkerProcess) -> None:
    finished = subprocess.run(
        [*EDGEQ, "status", "--json"],
        env={**os.environ, **tls_worker.env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    assert '"workers"' in finished.stdout and QUEUE in finished.stdout


async def test_the_gateway_serves_over_tls(
    tls_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {name: tls_worker.env[name] for name in ("EDGEQ_REDIS_URL", "EDGEQ_QUEUE", "EDGEQ_MODEL")}
    gateway = GatewayProcess(env, tmp_path_factory.mktemp("tls-gateway") / "gateway.log").start()
    try:
        async with openai.AsyncOpenAI(
            base_url=gateway.base_url, api_key="EMPTY", max_retries=0
        ) as sdk:
            completion = await sdk.chat.completions.create(
                model=env["EDGEQ_MODEL"],
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
            )
        assert completion.usage.completion_tokens >= 1
    finally:
        gateway.stop()


async def test_a_wrong_ca_is_a_clear_error_for_the_client(
    tls_redis: RedisServer, wrong_ca: Path
) -> None:
    url = rediss_url(tls_redis.port, wrong_ca)
    async with ChatClient(redis_url=url, queue=QUEUE) as client:
        with pytest.raises(RedisUnavailable) as refused:
            await client.submit("hi")
    message = str(refused.value)
    assert "certificate verify failed" in message
    assert "ssl_ca_certs=" in message and "EDGEQ_REDIS_URL" in message


def test_a_wrong_ca_stops_cli_and_worker_with_69_before_the_engine_loads(
    tls_redis: RedisServer, wrong_ca: Path, tiny_model: Path
) -> None:
    env = {**os.environ, **engine_env(tiny_model, rediss_url(tls_redis.port, wrong_ca), QUEUE)}
    status = subprocess.run([*EDGEQ, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == EXIT_UNAVAILABLE
    assert "certificate verify failed" in status.stderr
    worker = subprocess.run(
        [*EDGEQ, "worker"], env=env | {"EDGEQ_METRICS_PORT": "0"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == EXIT_UNAVAILABLE, worker.stderr
    assert "certificate verify failed" in worker.stderr and "ssl_ca_certs=" in worker.stderr
    assert "Loading weights" not in worker.stdout + worker.stderr  # the engine never started
