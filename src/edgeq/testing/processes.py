"""Running edgeq's real parts on this machine: a private redis-server and worker processes.

Used by ``make demo``, the test suite and the benchmarks, so that all of them start Redis and
the worker the same way and wait for the same readiness signal (the worker's ``worker_ready``
log event).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgeq.testing.tls import TlsFiles, rediss_url

READY_EVENT = "worker_ready"
READY_LOG_LEVELS = {"debug", "info"}
# Engine start-up measured here is ~20-40 s on two cores; leave room for a busy machine.
DEFAULT_READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


#: Where free ports are picked: above the well-known ones, below the kernel's ephemeral range.
LOWEST_PICKED_PORT = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _port_block() -> range:
    """The ports this process picks from: below the ephemeral range, and a block of its own
    per pytest-xdist process, so two test processes never pick the same port."""
    try:
        top = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768  # Linux's default
    ports = range(LOWEST_PICKED_PORT, max(top, LOWEST_PICKED_PORT + 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count < 2:
        return ports
    size = len(ports) // count
    start = ports.start + int(worker[2:]) % count * size
    return range(start, start + size)


def free_port() -> int:
    """A loopback port nobody listens on, for a child process to bind later.

    Not one the kernel picks (port 0): that one is in the ephemeral range, where every outgoing
    connection on the machine takes its local port too, and one took a worker's metrics port
    between the pick and the worker's bind (CI run 19: "Address already in use"). Picked at
    random from this process's block (``_port_block``), checked free, never handed out twice.
    """
    block = _port_block()
    for _ in range(200):
        port = random.choice(block)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # the block is full: the kernel's pick, as a last resort
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny_model_env(model: Path | str, redis_url: str, queue: str) -> dict[str, str]:
    """Settings for a local worker on a model directory, sized for a small CPU machine: the
    KV cache takes 1 GiB of RAM instead of EDGEQ_CPU_KV_CACHE_GIB's 4, and nothing is fetched
    from the Hub."""
    return {
        "EDGEQ_MODEL": str(model),
        "EDGEQ_REDIS_URL": redis_url,
        "EDGEQ_QUEUE": queue,
        "EDGEQ_CPU_KV_CACHE_GIB": "1",
        "HF_HUB_OFFLINE": "1",
    }


def spawn_edgeq(
    command: str,
    env: Mapping[str, str],
    log_path: Path,
    *,
    args: Sequence[str] = (),
    python: str = sys.executable,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``edgeq COMMAND [ARGS]`` as a child with stdout and stderr in ``log_path``, in a session
    of its own: a signal for the caller (Ctrl-C in a test run) is not one for the child. ``python``
    is the interpreter of the edgeq to run (another venv's, for an installed wheel), ``cwd``
    its working directory (``python -m`` puts it first on the import path)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [python, "-m", "edgeq", command, *args],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_process(process: subprocess.Popen[bytes], sig: signal.Signals) -> int:
    """Signal the process, wait STOP_TIMEOUT_S for it, then kill it; its exit status."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:g} s")


def wait_until_loaded(port: int, timeout_s: float) -> None:
    """Wait while a Redis on ``port`` answers LOADING (reading its data from disk): it listens
    before it serves, and a test that went on at once met BusyLoadingError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
                connection.sendall(b"PING\r\n")
                reply = connection.recv(128)
        except OSError:  # a TLS port hangs up on plain text: nothing to tell from it
            return
        if not reply.startswith(b"-LOADING"):  # +PONG, or -NOAUTH where a password is set
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis on 127.0.0.1:{port} still loading after {timeout_s:g} s")
        time.sleep(0.02)


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    return binary


@dataclass
class RedisServer:
    """A throw-away redis-server on loopback: no persistence, its own port. With ``tls`` the
    port speaks TLS only (clients are not asked for certificates)."""

    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    tls: TlsFiles | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return rediss_url(self.port, self.tls.ca)
        return f"redis://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            *("--port", "0", "--tls-port", str(self.port)),
            *("--tls-cert-file", str(self.tls.certificate), "--tls-key-file", str(self.tls.key)),
            *("--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"),
        ]

    def start(self) -> RedisServer:
        binary = redis_server_binary()
        self.process = subprocess.Popen(
            [
                binary,
                *self._listen_args(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout_s=10)
            wait_until_loaded(self.port, timeout_s=30)
        except BaseException:  # not left running behind a start that failed
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM)
        self.process = None


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a child process's log, for an error message or a failed test."""
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class WorkerFailed(RuntimeError):
    """The worker process exited or never became ready; the message has its last log lines."""


@dataclass
class WorkerProcess:
    """``edgeq worker`` as a child process with its settings in the environment (or another
    command that runs the worker, such as ``edgeq simulate-box``)."""

    env: Mapping[str, str]
    log_path: Path
    command: str = "worker"
    args: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None
    ready_event: dict[str, object] | None = None
    metrics_port: int | None = None
    python: str = sys.executable
    cwd: Path | None = None

    def start(self) -> WorkerProcess:
        env = {**os.environ, **self.env}
        # Several local workers (tests, bench --compare) must not fight over one port.
        env.setdefault("EDGEQ_METRICS_PORT", str(free_port()))
        self.metrics_port = int(env["EDGEQ_METRICS_PORT"]) or None
        if env.get("EDGEQ_LOG_LEVEL", "info").lower() not in READY_LOG_LEVELS:
            env["EDGEQ_LOG_LEVEL"] = "info"  # the ready event is an info line
        self.process = spawn_edgeq(
            self.command, env, self.log_path, args=self.args, python=self.python, cwd=self.cwd
        )
        return self

    def wait_ready(self, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            event = self._find_ready_event()
            if event is not None:
                self.ready_event = event
                return event
            if self.process is None or self.process.poll() is not None:
                raise WorkerFailed(f"the worker exited before it was ready:\n{self.tail()}")
            time.sleep(0.1)
        raise WorkerFailed(f"the worker was not ready after {timeout_s:g} s:\n{self.tail()}")

    def _find_ready_event(self) -> dict[str, object] | None:
        if not self.log_path.exists():
            return None
        for line in self.log_path.read_text(errors="replace").splitlines():
            if READY_EVENT in line and line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == READY_EVENT:
                    return event
        return None

    def log_events(self) -> list[dict[str, object]]:
        """The worker's structured events so far (vLLM's own plain-text lines left out)."""
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return events

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int | None:
        """Signal the worker and wait for it (and vLLM's child processes) to exit."""
        if self.process is None:
            return None
        returncode = stop_process(self.process, sig)
        # vLLM's engine processes share the worker's session; none may outlive it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return returncode


@dataclass
class GatewayProcess:
    """``edgeq gateway`` as a child process on its own loopback port."""

    env: Mapping[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        env = {
            **os.environ,
            **self.env,
            "EDGEQ_GATEWAY_HOST": "127.0.0.1",
            "EDGEQ_GATEWAY_PORT": str(self.port),
        }
        self.process = spawn_edgeq("gateway", env, self.log_path)
        try:
            wait_for_port(self.port, timeout_s)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the gateway did not start:\n{self.log_path.read_text()}") from None
        return self

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> int | None:
        return None if self.process is None else stop_process(self.process, signal.SIGTERM)
