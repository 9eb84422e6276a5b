"""Helpers shared by the tests: how a client in another language would use the wire contract."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import redis
from redis.asyncio import Redis

from edgeq.core.keys import stream_channel, wake_channel
from edgeq.core.protocol import JOB_FUNCTION, DoneEvent, ErrorEvent, StreamEvent
from edgeq.testing.processes import (
    WorkerProcess,
    free_port,
    redis_server_binary,
    stop_process,
    tiny_model_env,
    wait_for_port,
)
from edgeq.worker.engine_processes import engine_pids

# The tiny model's context in tests: short, so "prompt too long" is cheap to provoke, and long
# enough for Qwen3's tools section (~400 tokens of the tiny vocabulary) with an answer.
TEST_MAX_MODEL_LEN = 1024
# A small step budget, so that ordinary prompts in the tests are prefilled in several chunks.
TEST_MAX_NUM_BATCHED_TOKENS = 128
EDGEQ = [sys.executable, "-m", "edgeq"]
TERMINAL_TYPES = {"done", "error"}
# On the near-uniform tiny model the seed, not the prompt, decides when <|im_end|> is drawn;
# these seeds run 300 tokens without it on each of 18 prompts the tests use (seen on this
# machine type, for the character-level tiny model; 8 of seeds 0-39 do).
FULL_LENGTH_SEEDS = (10, 16, 18)
# How long the test Sentinel waits before it calls an unanswering master down.
SENTINEL_DOWN_AFTER_MS = 30_000
# Figures measured by the tests (chaos, gateway), printed at the end of the run.
FIGURES: dict[str, object] = {}


def engine_env(model: Path, redis_url: str, queue: str) -> dict[str, str]:
    """Settings for a worker on the tiny model, sized for a 2-core test machine."""
    return tiny_model_env(model, redis_url, queue) | {
        "EDGEQ_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "EDGEQ_MAX_NUM_BATCHED_TOKENS": str(TEST_MAX_NUM_BATCHED_TOKENS),
    }


def engine_of(worker: WorkerProcess | subprocess.Popen[bytes]) -> list[psutil.Process]:
    """vLLM's processes of the worker (not multiprocessing's resource tracker); ``worker`` may
    also be the bare process of an installed worker."""
    process = worker if isinstance(worker, subprocess.Popen) else worker.process
    return [psutil.Process(pid) for pid in engine_pids(process.pid)]


def suspend_engine(worker: WorkerProcess) -> list[psutil.Process]:
    """Suspend the worker's engine processes: its chats stay running however fast this
    machine is, while the worker itself still claims, starts and publishes what it has.
    Returns them, to resume."""
    engine = engine_of(worker)
    for process in engine:
        process.suspend()
    return engine


@contextmanager
def suspended(processes: Sequence[psutil.Process]) -> Iterator[None]:
    """The processes suspended for the block, resumed after it (those still there)."""
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with suppress(psutil.NoSuchProcess):  # its worker was killed meanwhile
                process.resume()


def frozen(worker: WorkerProcess) -> AbstractContextManager[None]:
    """The worker's engine suspended for the block (as ``suspend_engine``): chats sent before
    or during it stay running."""
    return suspended(engine_of(worker))


#: Where the tests' engine throttles live (cgroup v1's cpu controller, as on the CI machines).
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000
CGROUP_EMPTY_TIMEOUT_S = 30


class SlowedEngines:
    """The engines of some workers held by the kernel to a share of one CPU each (a cgroup of
    their own with a CFS quota), so their chats last many times longer while the workers,
    Redis and the test run at full speed: at 15 % a 300-token answer took 11 s instead of
    0.65 s here (its engine's idle polling takes its share too).

    For tests that act on a chat while it is still running. Freezing on its first event is
    not enough under a loaded suite: probes of full runs measured the workers' Redis round
    trips at up to 0.7-0.94 s, while a whole 300-token answer takes ~0.6 s; the engine
    goes on meanwhile, so a chat could end before anyone saw its first event. Suspending and
    resuming the engine from a thread of the test does not hold either: the test process
    starves too, and the engine ran free while it did (a CI run)."""

    def __init__(
        self, workers: Sequence[WorkerProcess | subprocess.Popen[bytes]], *, cpu_share: float
    ) -> None:
        self._engines = [engine_of(worker) for worker in workers]
        self._quota_us = max(1000, int(cpu_share * CFS_PERIOD_US))
        self._groups: list[Path] = []
        self._came_from: dict[int, Path] = {}

    def start(self) -> SlowedEngines:
        for engine in self._engines:  # a quota per engine: one busy engine cannot take another's
            group = CPU_CGROUPS / f"edgeq-test-slowed-{uuid.uuid4().hex[:8]}"
            group.mkdir()
            self._groups.append(group)
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(self._quota_us))
            for process in engine:
                self._came_from[process.pid] = _cpu_cgroup_of(process.pid)
                (group / "cgroup.procs").write_text(str(process.pid))
        return self

    def stop(self) -> None:
        """Give the engines back their own cgroups (and all the CPU they can get)."""
        for group in self._groups:
            deadline = time.monotonic() + CGROUP_EMPTY_TIMEOUT_S
            while True:
                # What is still in it: the engines, or a killed worker's, still exiting.
                for pid in map(int, (group / "cgroup.procs").read_text().split()):
                    home = self._came_from.get(pid, CPU_CGROUPS)
                    with suppress(ProcessLookupError):  # gone meanwhile
                        (home / "cgroup.procs").write_text(str(pid))
                try:
                    group.rmdir()
                    break
                except OSError:  # a process was exiting in it: it leaves when it is gone
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def held(self) -> AbstractContextManager[None]:
        """The engines suspended for the block."""
        return suspended([p for engine in self._engines for p in engine if p.is_running()])


def _cpu_cgroup_of(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_CGROUPS / path.lstrip("/")
    raise RuntimeError(f"process {pid} is in no cpu cgroup")


@contextmanager
def slowed(
    *workers: WorkerProcess | subprocess.Popen[bytes], cpu_share: float = 0.15
) -> Iterator[SlowedEngines]:
    """The workers' engines held to ``cpu_share`` of one CPU for the block (``SlowedEngines``)."""
    engines = SlowedEngines(workers, cpu_share=cpu_share)
    try:
        yield engines.start()
    finally:
        engines.stop()  # also after a start that failed half-way: no engine stays throttled


@contextmanager
def ready_worker(env: dict[str, str], log_path: Path) -> Iterator[WorkerProcess]:
    """A worker process, warm and serving, stopped (with its engine) when the block ends."""
    process = WorkerProcess(env, log_path).start()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def arq_job_bytes(request: Any) -> bytes:
    """A chat job exactly as README's wire contract spells it for other languages."""
    job = {"f": JOB_FUNCTION, "a": [request], "k": {}, "t": 1, "et": int(time.time() * 1000)}
    return json.dumps(job).encode()


async def enqueue_raw(redis: Redis, queue: str, payload: bytes, job_id: str | None = None) -> str:
    """Enqueue with plain Redis commands (no arq client), as README's wire contract says: SET
    the job, ZADD its id, PUBLISH the queue's wake (or the job waits for the worker's next look)."""
    job_id = job_id or uuid.uuid4().hex
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(f"arq:job:{job_id}", payload, px=60_000)
        pipe.zadd(queue, {job_id: int(time.time() * 1000)})
        pipe.publish(wake_channel(queue), "")
        await pipe.execute()
    return job_id


def assert_intact(events: list[StreamEvent], job_id: str) -> None:
    """seq 0, 1, 2, … with no gap, all of this job, one terminal event and it comes last."""
    assert [event.seq for event in events] == list(range(len(events)))
    assert all(event.job_id == job_id for event in events)
    assert isinstance(events[-1], DoneEvent | ErrorEvent)
    assert not any(isinstance(event, DoneEvent | ErrorEvent) for event in events[:-1])


async def run_raw_job(
    redis: Redis, queue: str, payload: bytes, timeout_s: float = 60
) -> list[dict[str, Any]]:
    """Subscribe (and wait for the confirmation), enqueue a raw payload, collect its events."""
    job_id = uuid.uuid4().hex
    pubsub = redis.pubsub()
    await pubsub.subscribe(stream_channel(job_id))
    confirmation = await pubsub.get_message(timeout=5)
    assert confirmation is not None and confirmation["type"] == "subscribe"
    await enqueue_raw(redis, queue, payload, job_id)
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not events or events[-1]["type"] not in TERMINAL_TYPES:
            assert time.monotonic() < deadline, f"no terminal event for {job_id}: {events}"
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                events.append(json.loads(message["data"]))
    finally:
        await pubsub.aclose()
    assert all(event["job_id"] == job_id for event in events)
    return events


# --- Redis Sentinel ----------------------------------------------------------------------------

SENTINEL_START_TIMEOUT_S = 15.0


@dataclass
class SentinelServer:
    """A throw-away Redis Sentinel on loopback monitoring one master as ``service``.

        sentinel = SentinelServer(master_port=redis_server.port, directory=tmp_path).start()
        env = engine_env(model, sentinel.url(), queue)   # a worker (or ChatClient) through it
        ...
        sentinel.stop()

    ``master_password`` is the data nodes' password (Sentinel's ``auth-pass``);
    ``requirepass`` makes the Sentinel itself require one (``url()`` then carries it);
    ``extra_config`` lines are added to its config file (TLS to the data nodes, say).
    """

    master_port: int
    directory: Path
    service: str = "edgeq"
    master_password: str | None = None
    requirepass: str | None = None
    extra_config: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def url(self, *, db: int = 0, password: str | None = None, service: str | None = None) -> str:
        """The EDGEQ_REDIS_URL naming this Sentinel; ``password`` is the data nodes'."""
        credentials = f":{quote(password, safe='')}@" if password else ""
        query = f"?sentinel_password={quote(self.requirepass, safe='')}" if self.requirepass else ""
        name = quote(service or self.service, safe="")
        return f"redis+sentinel://{credentials}127.0.0.1:{self.port}/{name}/{db}{query}"

    def start(self) -> SentinelServer:
        binary = redis_server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / f"sentinel-{self.port}.conf"  # Sentinel rewrites it: writable
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.directory}",
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1",
            # Failovers in the tests are forced (SENTINEL FAILOVER); a master merely slow for
            # a second on a loaded 2-core box must not be reported down ("No master found").
            f"sentinel down-after-milliseconds {self.service} {SENTINEL_DOWN_AFTER_MS}",
            f"sentinel failover-timeout {self.service} 5000",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        if self.master_password:
            lines.append(f"sentinel auth-pass {self.service} {self.master_password}")
        if self.requirepass:
            lines.append(f"requirepass {self.requirepass}")
        lines.extend(self.extra_config)
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout_s=10)
            self.wait_for_master(("127.0.0.1", self.master_port))
        except BaseException:
            self.stop()
            raise
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.requirepass, socket_timeout=2)

    def wait_for_master(
        self, address: tuple[str, int], timeout_s: float = SENTINEL_START_TIMEOUT_S
    ) -> None:
        """Until the Sentinel names ``address`` as the master and sees it up and connected."""
        deadline = time.monotonic() + timeout_s
        with self.client() as sentinel:
            while True:
                named = sentinel.sentinel_get_master_addr_by_name(self.service)
                if named is not None and (named[0].decode(), int(named[1])) == address:
                    state = sentinel.sentinel_master(self.service)
                    if state["flags"] == "master":  # not s_down, o_down, disconnected
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Sentinel :{self.port} names no master at {address}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM)
        self.process = None


# --- Redis Cluster -----------------------------------------------------------------------------

CLUSTER_START_TIMEOUT_S = 30.0
# How long a node may not answer before the others fail it over themselves. No test waits for
# that (failovers here are asked for: CLUSTER FAILOVER); a shorter one let a node starved by a
# loaded 2-core machine be failed over and come back as a replica still resyncing when a test
# wanted a replica in sync (a clean-clone run, 5 s).
CLUSTER_NODE_TIMEOUT_MS = 15_000
# A replica in sync, and a failover agreed: after a failover the cluster made itself, the
# primaries refuse their vote to another replica of the same primary for twice the node timeout.
CLUSTER_FAILOVER_TIMEOUT_S = 2 * CLUSTER_NODE_TIMEOUT_MS / 1000 + 30
# Redis abandons a manual failover the replica could not finish after 5 s (CLUSTER_MF_TIMEOUT).
MANUAL_FAILOVER_TIMEOUT_S = 6.0


# A cluster node also listens on its port + 10000 (the cluster bus).
CLUSTER_BUS_OFFSET = 10_000


def _cluster_port() -> int:
    """A free port whose cluster bus port is free too."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET >= 65536:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port


@dataclass
class LocalCluster:
    """A throw-away Redis Cluster on loopback: ``primaries`` primaries with one replica each,
    made with ``redis-cli --cluster create`` from Debian's redis-server, no persistence.

        cluster = LocalCluster(tmp_path).start()
        env = engine_env(model, cluster.url, "{edgeq:queue}")
        ...
        cluster.stop()
    """

    directory: Path
    primaries: int = 3
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        """EDGEQ_REDIS_URL naming two of the nodes as seeds."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:2])

    def start(self) -> LocalCluster:
        binary = redis_server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ports = [_cluster_port() for _ in range(2 * self.primaries)]
        try:
            for port in self.ports:
                self.processes.append(
                    subprocess.Popen(
                        [
                            *(binary, "--port", str(port), "--bind", "127.0.0.1"),
                            *("--cluster-enabled", "yes", "--dir", str(self.directory)),
                            *("--cluster-config-file", f"nodes-{port}.conf"),
                            *("--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)),
                            *("--save", "", "--appendonly", "no"),
                            *("--logfile", str(self.directory / f"redis-{port}.log")),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )
                )
            for port in self.ports:
                wait_for_port(port, timeout_s=10)
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{port}" for port in self.ports),
                    *("--cluster-replicas", "1", "--cluster-yes"),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_until_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def wait_until_ok(self, timeout_s: float = CLUSTER_START_TIMEOUT_S) -> None:
        """Until every node says the cluster is ok and they agree on every slot's owner."""
        deadline = time.monotonic() + timeout_s
        while True:
            states, owners = set(), set()
            for port in self.ports:
                with self.node(port) as node:
                    states.add(node.execute_command("CLUSTER INFO").get("cluster_state"))
                    owners.add(tuple(sorted(self._primaries_of(node))))
            if states == {"ok"} and len(owners) == 1:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster is not ok: {states}, {len(owners)} views")
            time.sleep(0.1)

    @staticmethod
    def _primaries_of(node: redis.Redis) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary port) of each slot range, as ``node`` sees them."""
        return [
            (int(first), int(last), int(primary[1]))
            for first, last, primary, *_ in node.execute_command("CLUSTER SLOTS")
        ]

    def owner(self, slot: int) -> int:
        """The port of the primary serving ``slot`` now."""
        with self.node(self.ports[0]) as node:
            for first, last, port in self._primaries_of(node):
                if first <= slot <= last:
                    return port
        raise LookupError(f"no node serves slot {slot}")

    def online_replicas_of(self, primary_port: int) -> list[int]:
        """The ports of the replicas in sync with ``primary_port``; none if it is no primary."""
        with self.node(primary_port) as node:
            info = node.info("replication")
        if info["role"] != "master":
            return []
        replicas = (info[f"slave{n}"] for n in range(int(info["connected_slaves"])))
        return [int(replica["port"]) for replica in replicas if replica["state"] == "online"]

    def _primary_with_a_replica(self, slot: int) -> tuple[int, int]:
        """(primary, replica in sync) for ``slot``. A CI run found the primary with no replica
        connected: a link that dropped, or a node the loaded machine starved past
        ``CLUSTER_NODE_TIMEOUT_MS``, which the cluster fails over itself and which comes back
        as a replica that must resync. Replicas are also in their first sync for ~5 s after
        ``start`` (the cluster says ok before)."""
        deadline = time.monotonic() + CLUSTER_FAILOVER_TIMEOUT_S
        while True:
            self.wait_until_ok()
            primary = self.owner(slot)
            replicas = self.online_replicas_of(primary)
            if replicas:
                return primary, replicas[0]
            if time.monotonic() > deadline:
                with self.node(primary) as node:
                    replication = node.info("replication")
                raise TimeoutError(
                    f"slot {slot}'s primary :{primary} has no replica in sync: {replication}; "
                    f"the nodes' logs are in {self.directory}"
                )
            time.sleep(0.1)

    def fail_over(self, slot: int) -> tuple[int, int]:
        """Promote the replica of ``slot``'s primary (``CLUSTER FAILOVER``, no writes lost);
        (old primary, new primary) once every node agrees."""
        old, new = self._primary_with_a_replica(slot)
        deadline = time.monotonic() + CLUSTER_FAILOVER_TIMEOUT_S
        while self.owner(slot) != new:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica :{new} did not take over slot {slot}")
            # Asked again when Redis has given up on the last one: primaries refuse their vote
            # to a replica of the same primary for twice the node timeout after an election
            # (measured: right after the cluster failed a node over itself, the first ask
            # came to nothing).
            with self.node(new) as node:
                node.execute_command("CLUSTER FAILOVER")
            retry_at = time.monotonic() + MANUAL_FAILOVER_TIMEOUT_S
            while self.owner(slot) != new and time.monotonic() < retry_at:
                time.sleep(0.05)
        self.wait_until_ok()
        return old, new

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process, signal.SIGTERM)
        self.processes = []


#: The flaky webhook endpoint refuses each webhook-id this often, then takes it.
FLAKY_REFUSALS = 3


class WebhookReceiver:
    """Webhook endpoints on loopback: /ok takes every event, /flaky refuses each webhook-id's
    first FLAKY_REFUSALS attempts, /hang answers only once closed (or after 30 s). Every
    request is kept: (path, headers, body, status sent, when)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, str], bytes, int, float]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {name.lower(): value for name, value in self.headers.items()}
                if self.path == "/hang":
                    receiver.release.wait(30)
                with receiver.lock:
                    seen = receiver._attempts(self.path, headers["webhook-id"])
                    status = 503 if self.path == "/flaky" and seen < FLAKY_REFUSALS else 200
                    receiver.got.append((self.path, headers, body, status, time.monotonic()))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def delivered(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        """What ``path`` took (answered 200), in arrival order."""
        with self.lock:
            return [(h, b) for p, h, b, status, _ in self.got if p == path and status == 200]

    def accepted(self, path: str, webhook_id: str) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in self.delivered(path) if h["webhook-id"] == webhook_id]

    def attempts(self, path: str, webhook_id: str) -> int:
        with self.lock:
            return self._attempts(path, webhook_id)

    def _attempts(self, path: str, webhook_id: str) -> int:
        return sum(1 for got in self.got if got[0] == path and got[1]["webhook-id"] == webhook_id)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
