"""docs/troubleshooting.md quotes what edgeq prints "word for word": each case is produced here
with real parts (a real redis-server, with and without a password, a real gateway with no
worker behind it, the real CLI) and the line it prints must be on the page, with the page's
placeholders (``<job id>``, the default port 6379, the default 120 s) put in for the values
this test chose. The page's runnable examples also run in tests/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.testing.processes import GatewayProcess, RedisServer

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs/troubleshooting.md"
EDGEQ = [sys.executable, "-m", "edgeq"]
JOB_ID = re.compile(r"job [0-9a-f]{32}")


def page() -> str:
    return PAGE.read_text()


def run_edgeq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGEQ_")}
    return subprocess.run(
        [*EDGEQ, *args], env=clean | env, capture_output=True, text=True, timeout=120,
        cwd=REPO / "tests",  # no .env of a developer's checkout
    )  # fmt: skip


def on_page(text: str) -> None:
    assert text.strip() in page(), f"not on docs/troubleshooting.md:\n{text}"


@pytest.fixture(scope="module")
def plain_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def password_redis() -> Iterator[RedisServer]:
    server = RedisServer(extra_args=("--requirepass", "s3cret")).start()
    yield server
    server.stop()


def test_exit_69_redis_cannot_be_reached() -> None:
    result = run_edgeq("status", env={"EDGEQ_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert result.returncode == 69
    on_page(result.stderr + "exit 69")


def test_exit_78_an_invalid_setting() -> None:
    result = run_edgeq("status", env={"EDGEQ_STREAM_TIMEOUT_S": "-1"})
    assert result.returncode == 78
    on_page(result.stderr + "exit 78")


def test_noauth_without_a_password_and_with_a_wrong_one(password_redis: RedisServer) -> None:
    port = str(password_redis.port)
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0"):
        result = run_edgeq("status", env={"EDGEQ_REDIS_URL": url})
        assert result.returncode == 69
        on_page(result.stderr.replace(f":{port}/", ":6379/"))


@pytest.fixture(scope="module")
def gateway_without_worker(
    plain_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    env = {"EDGEQ_REDIS_URL": plain_redis.url, "EDGEQ_STREAM_TIMEOUT_S": "1"}
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    gateway = GatewayProcess(env, log).start()
    yield gateway
    gateway.stop()


def http(url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def as_on_page(text: str) -> str:
    """The stream timeout's message with the page's job id and default wait."""
    return JOB_ID.sub("job <job id>", text).replace("no event for 1 s", "no event for 120 s")


def test_503_no_warm_worker(gateway_without_worker: GatewayProcess) -> None:
    status, body = http(f"http://127.0.0.1:{gateway_without_worker.port}/ready")
    assert status == 503
    on_page(body)


def test_504_stream_timeout_streamed_or_not(gateway_without_worker: GatewayProcess) -> None:
    chat = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        status, body = http(
            f"{gateway_without_worker.base_url}/chat/completions", chat | {"stream": stream}
        )
        assert status == 504
        on_page(as_on_page(body))


def test_edgeq_chat_times_out_with_the_same_sentence(plain_redis: RedisServer) -> None:
    env = {"EDGEQ_REDIS_URL": plain_redis.url, "EDGEQ_STREAM_TIMEOUT_S": "1"}
    result = run_edgeq("chat", "hi", "--max-tokens", "4", env=env)
    assert result.returncode == 1
    on_page(as_on_page(result.stderr))


def test_the_gateway_exits_69_when_its_port_is_taken(
    plain_redis: RedisServer, tmp_path: Path
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_edgeq(
            "gateway", "--port", str(port), env={"EDGEQ_REDIS_URL": plain_redis.url}
        )
    assert result.returncode == 69
    line = result.stderr.strip().splitlines()[-1]
    on_page(line.replace(f"127.0.0.1:{port}", "<host>:<port>"))


@pytest.mark.engine  # imports vLLM (seconds of a core), though it never builds an engine
def test_an_engine_that_will_not_start_a_model_path_that_is_not_there(
    plain_redis: RedisServer,
) -> None:
    env = {
        "EDGEQ_REDIS_URL": plain_redis.url,
        "EDGEQ_MODEL": "/nonexistent/model",
        "HF_HUB_OFFLINE": "1",
        # No metrics server: the default port 9400 may be another test's at the same moment
        # (a clean-clone run got exit 78, "Address already in use", instead of the engine's 1).
        "EDGEQ_METRICS_PORT": "0",
    }
    result = run_edgeq("worker", env=env)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("edgeq worker: stopped: ")
    on_page(line)
