"""Real parts for the suite: a private redis-server, the generated tiny model, and ONE worker
process with the real vLLM engine, shared by every test that needs it (engine start-up is the
suite's biggest cost)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from helpers import FIGURES, engine_env
from producer.client import ChatClient
from worker.localrun import RedisServer, WorkerProcess
from worker.tiny_model import make_tiny_model


@pytest.fixture
def clean_edgeq_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No EDGEQ_* variable from the caller's environment and no stray .env."""
    for name in list(os.environ):
        if name.startswith("EDGEQ_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model")).directory


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client of the session's redis-server (the shared worker's Redis too)."""
    connection = Redis.from_url(redis_server.url)
    yield connection
    await connection.aclose()


@pytest.fixture
def queue() -> str:
    """A queue name no other test uses."""
    return f"edgeq:test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def worker(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    env = engine_env(tiny_model, redis_server.url, "edgeq:test")
    process = WorkerProcess(env, tmp_path_factory.mktemp("worker") / "worker.log").start()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
async def client(worker: WorkerProcess) -> AsyncIterator[ChatClient]:
    async with ChatClient(
        redis_url=worker.env["EDGEQ_REDIS_URL"], queue=worker.env["EDGEQ_QUEUE"]
    ) as chat_client:
        yield chat_client


@pytest.fixture
def cli_env(worker: WorkerProcess) -> dict[str, str]:
    """Environment for running `edgeq ...` against the shared worker."""
    return {**os.environ, **worker.env}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("figures measured by the tests")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")
