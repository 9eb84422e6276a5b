"""``edgeq chaos``: a chaos campaign the project runs on itself (issue #34).

One run starts its own redis-server (append-only file on, as the installer configures it), N
workers on one model under a small supervisor that restarts a dead worker after
RESTART_DELAY_S (systemd's ``Restart=always``), optionally the gateway, and then, for
``duration_s``:

- keeps K chats in flight, a seeded mix of kinds (``JOB_KINDS``) over several tenants and
  priority classes, through the Python client (and the gateway's HTTP API with ``--gateway``);
- injects a seeded schedule of faults, one at a time (``FAULT_KINDS``): worker SIGKILL, worker
  SIGSTOP past its lease, Redis restart (SIGTERM or SIGKILL, same port and data), Redis away
  past the workers' outage limit, gateway SIGKILL, and one worker's link to Redis slowed or
  cut: each worker reaches Redis through a proxy of the harness's own (testing/link.py);
  and, when named, one worker's engine frozen, or a poison request that kills every engine
  it reaches (``OPT_IN_FAULT_KINDS``).

Every accepted job is then checked against docs/guarantees.md (``check_job``): one terminal
event, ``seq`` gap-free and unrepeated, the live stream equal to the replay buffer, arq's
result text equal to the deltas, a JSON answer that stopped parses, and a reader that never
got RedisUnavailable. At the end nothing may stay queued or leased, no engine process may
outlive its worker, and no engine socket directory may be left. The report (``Report``) counts
jobs and refusals, lists each problem with the fault windows it overlapped, and gives TTFT
inside and outside fault windows. The same seed gives the same fault schedule and the same
sequence of jobs; what the machine's timing makes of them varies.

Imports psutil-free on purpose: a worker is frozen with ``killpg`` (its engine processes are
in its process group), so the command runs from a plain ``edgeq[cpu]`` install.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeq.core.connection import redis_errors
from edgeq.core.dead_letter import read_dead_letter
from edgeq.core.errors import (
    EdgeqError,
    JobTimeout,
    PoisonRefused,
    QueueFull,
    RedisUnavailable,
    StreamBroken,
)
from edgeq.core.events import read_events
from edgeq.core.keys import in_progress_key, leases_key, result_key
from edgeq.core.leases import POISON_AFTER_ENGINE_FAILURES, engine_failures
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, StreamEvent
from edgeq.exit_codes import EXIT_ENGINE_STALLED, EXIT_JOB_FAILED
from edgeq.testing.engine_poison import POISON_ENV, POISON_SEED
from edgeq.testing.link import LinkProxy
from edgeq.testing.processes import (
    DEFAULT_READY_TIMEOUT_S,
    GatewayProcess,
    RedisServer,
    WorkerFailed,
    WorkerProcess,
    tiny_model_env,
)

# --- knobs -------------------------------------------------------------------------------------

#: A dead worker (or gateway) is started again after this long, like systemd's RestartSec.
RESTART_DELAY_S = 2.0
#: The workers' and clients' EDGEQ_LEASE_TTL_S: short, so take-overs happen within a short
#: campaign, long enough that two busy engines on two cores are not mistaken for dead ones
#: (tests/chaos/test_guarantees.py's BUSY_LEASE_TTL_S).
DEFAULT_LEASE_TTL_S = 5.0
#: The workers' EDGEQ_REDIS_OUTAGE_S: an outage past it makes them give their chats up.
DEFAULT_OUTAGE_LIMIT_S = 8.0
#: After a fault ends, jobs are still "in its window" this long (take-overs, reconnects).
RECOVERY_S = 5.0
#: When load ends, how long the jobs still running get to end (a client rides out up to
#: EDGEQ_STREAM_TIMEOUT_S of silence, so longer than that).
LANES_DRAIN_S = 240.0
#: Then how long the queue and the leases get to empty before what is left is a problem.
QUIET_DRAIN_S = 60.0
#: How long a check waits for Redis (it may be in a fault window) before giving up.
REDIS_PATIENCE_S = 90.0
#: arq's result is written just after the done event: how long to look for it.
RESULT_WAIT_S = 5.0
#: The gateway's answers that are a refusal at the door (queue full, Redis away), not a fault.
REFUSALS_AT_THE_DOOR = (429, 503)
#: A refused submit backs off this long, so an outage is no busy loop.
REFUSED_BACKOFF_S = 0.5
#: Engine processes must be gone this long after their workers stopped.
ENGINE_GONE_S = 30.0
#: The gaps between faults, and when the first comes (seconds after load started).
FAULT_GAP_S = (6.0, 12.0)
FIRST_FAULT_S = 5.0
#: The last share of the campaign has no fault starting in it: the box settles under load.
QUIET_TAIL = 0.15
#: Settings for the tiny model on a 2-core machine (tests/helpers.py engine_env).
TINY_ENGINE_ENV = {"EDGEQ_MAX_MODEL_LEN": "1024", "EDGEQ_MAX_NUM_BATCHED_TOKENS": "128"}
QUEUE = "edgeq:chaos"
#: A seed that draws no end-of-turn token for hundreds of tokens on the tiny model
#: (tests/helpers.py FULL_LENGTH_SEEDS): a "long" chat is really long.
LONG_SEED = 10

FAULT_KINDS = (
    "kill_worker", "stop_worker", "restart_redis", "redis_outage", "kill_gateway",
    "slow_link", "drop_link",
)  # fmt: skip
#: Faults a campaign runs only when ``--faults`` names them (not in the default mix, so the
#: seeded schedules of FAULT_KINDS stay as they were): ``freeze_engine`` SIGSTOPs one worker's
#: engine processes only, its worker left running, until the worker notices the stall and
#: ends itself (worker/liveness.py, exit 70); its chats must be continued elsewhere (#41).
#: ``poison`` submits a request that kills every engine that steps it (the workers run with
#: edgeq.testing.engine_poison armed): it must end ``poison_job`` after two engine deaths, be
#: in the dead-letter set, and be refused at the door when sent again (#41).
OPT_IN_FAULT_KINDS = ("freeze_engine", "poison")
ALL_FAULT_KINDS = FAULT_KINDS + OPT_IN_FAULT_KINDS
#: The workers' EDGEQ_ENGINE_STALL_S and EDGEQ_ENGINE_STALL_EXIT_S when engines are frozen:
#: short, so a frozen engine's worker ends within a campaign; far above the tiny model's
#: longest step (69 ms, docs/configuration.md).
CHAOS_ENGINE_STALL_S = 4.0
CHAOS_ENGINE_STALL_EXIT_S = 4.0
#: How long a frozen engine's worker gets to end itself, beyond the two settings.
STALLED_EXIT_GRACE_S = 30.0
#: Once a poison request ended, how long its two workers get to exit (each counts its
#: engine's death on the job first, then exits 1).
POISON_DEATHS_S = 60.0
#: The poison request's answer length (it never gets one).
POISON_MAX_TOKENS = 16
#: How late a slowed link delivers each byte, each way (seconds).
SLOW_LINK_DELAY_S = (0.05, 0.4)
JOB_KINDS = ("plain", "long", "json", "tool", "cancel", "deadline")
#: The poison request of a ``poison`` fault (not one of the workload's JOB_KINDS).
POISON_KIND = "poison"
#: Error codes a job may end with under faults (docs/guarantees.md); any other is a problem.
EXPECTED_CODES = {
    "cancel": {"cancelled", "expired", "worker_lost"},
    "deadline": {"expired", "worker_lost"},
    POISON_KIND: {"poison_job"},
}
DEFAULT_EXPECTED_CODES = {"expired", "worker_lost"}
TENANTS = ("alpha", "beta", "gamma")
PRIORITIES = ("interactive", "default", "batch")
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 24}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# --- the seeded plan: faults and jobs ----------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One planned fault: what, when (seconds after load started), for how long, on what."""

    kind: str
    at_s: float
    hold_s: float
    #: Picks the victim among the workers ready at the time (index modulo their number).
    target: int = 0
    #: The signal for a Redis restart (SIGTERM: a clean shutdown; SIGKILL: none).
    how: str = ""
    #: A slowed link's delay, each way (seconds).
    delay_s: float = 0.0


def fault_hold_s(kind: str, rng: random.Random, lease_ttl_s: float, outage_s: float) -> float:
    """How long a fault of ``kind`` lasts: a stopped worker stays stopped past its lease (so
    its jobs are handed over), Redis stays away past the outage limit for ``redis_outage``."""
    if kind == "stop_worker":
        return rng.uniform(1.5 * lease_ttl_s + 1, 2.5 * lease_ttl_s + 1)
    if kind == "restart_redis":
        return rng.uniform(0.5, 3.0)
    if kind == "redis_outage":
        return rng.uniform(outage_s + 2, outage_s + 5)
    if kind == "slow_link":
        return rng.uniform(3.0, 8.0)
    if kind == "drop_link":  # shorter than the lease (it rides it out) or well past it
        return rng.uniform(1.0, 2.5 * lease_ttl_s)
    # A kill is instant, and a frozen engine holds until its worker ends itself; the
    # supervisor restarts the process.
    return 0.0


def fault_schedule(
    seed: int,
    duration_s: float,
    kinds: Sequence[str],
    *,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    outage_s: float = DEFAULT_OUTAGE_LIMIT_S,
) -> list[Fault]:
    """The campaign's faults, one after another: first each kind once (in a seeded order, so
    even a short campaign has them all), then seeded picks until the quiet tail."""
    rng = random.Random(f"faults:{seed}")
    first_round = rng.sample(list(kinds), len(kinds))
    faults: list[Fault] = []
    at = FIRST_FAULT_S
    for index in itertools.count():
        kind = first_round[index] if index < len(first_round) else rng.choice(list(kinds))
        hold = round(fault_hold_s(kind, rng, lease_ttl_s, outage_s), 2)
        if index >= len(first_round) and at + hold > duration_s * (1 - QUIET_TAIL):
            break
        how = rng.choice(("SIGTERM", "SIGKILL")) if kind == "restart_redis" else ""
        delay = round(rng.uniform(*SLOW_LINK_DELAY_S), 3) if kind == "slow_link" else 0.0
        faults.append(Fault(kind, round(at, 2), hold, rng.randrange(1000), how, delay))
        at += hold + rng.uniform(*FAULT_GAP_S)
    return faults


def fault_start_s(fault: Fault, previous_ended_s: float | None) -> float:
    """When a planned fault starts: at its time, but never less than the shortest gap after
    the one before ended. A fault can come late (its victim had to be waited for); fired
    back to back behind it, the next ones left no worker serving for minutes while restarts
    were slow (a 30-minute run, #34)."""
    if previous_ended_s is None:
        return fault.at_s
    return max(fault.at_s, previous_ended_s + FAULT_GAP_S[0])


@dataclass(frozen=True)
class JobSpec:
    """One chat of the workload: its kind, the submit fields, and what the driver does."""

    index: int
    kind: str
    prompt: str
    fields: dict[str, Any]
    #: Seconds after the first delta at which the driver cancels (kind ``cancel``).
    cancel_after_s: float | None = None
    via_gateway: bool = False


def job_spec(seed: int, index: int, *, gateway: bool = False) -> JobSpec:
    """The workload's ``index``-th job: the same for the same seed, whichever driver lane
    takes it."""
    rng = random.Random(f"jobs:{seed}:{index}")
    kind = rng.choices(JOB_KINDS, weights=(30, 15, 15, 15, 10, 15))[0]
    fields: dict[str, Any] = {
        "tenant": rng.choice(TENANTS),
        "priority": rng.choice(PRIORITIES),
        "max_tokens": rng.randint(8, 24),
    }
    cancel_after_s = None
    if kind in ("long", "cancel"):
        fields |= {"max_tokens": rng.randint(150, 300), "seed": LONG_SEED}
    elif kind == "json":
        fields |= {
            "max_tokens": 48,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": ANSWER_SCHEMA},
            },
        }
    elif kind == "tool":
        fields |= {"max_tokens": 48, "tools": [WEATHER_TOOL]}
    elif kind == "deadline":
        fields["deadline_s"] = round(rng.uniform(0.2, 3.0), 2)
    if kind == "cancel":
        cancel_after_s = round(rng.uniform(0.0, 0.3), 3)
    via_gateway = gateway and kind in ("plain", "long", "json") and rng.random() < 0.4
    prompt = f"chaos {index}: {rng.choice(('hello', 'the sea', 'a lighthouse', 'weather'))}"
    return JobSpec(index, kind, prompt, fields, cancel_after_s, via_gateway)


# --- what happened to each job, and its checks -------------------------------------------------


@dataclass
class JobRecord:
    """One accepted job as the driver saw it (times are seconds after load started)."""

    spec: JobSpec
    job_id: str
    submitted_s: float
    first_delta_s: float | None = None
    ended_s: float | None = None
    events: list[StreamEvent] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: The gateway's HTTP stream broke (its gateway was killed): not a problem by itself.
    gateway_cut: bool = False

    @property
    def terminal(self) -> DoneEvent | ErrorEvent | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, DoneEvent | ErrorEvent) else None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, DeltaEvent))


def check_events(events: Sequence[StreamEvent], job_id: str) -> list[str]:
    """The stream's own guarantees: seq 0, 1, 2, ... once each, every event this job's, one
    terminal event and it comes last."""
    problems = []
    seqs = [event.seq for event in events]
    if seqs != list(range(len(seqs))):
        problems.append(f"seq not gap-free and unrepeated: {seqs[:20]}")
    if any(event.job_id != job_id for event in events):
        problems.append("an event of another job in the stream")
    terminals = [i for i, e in enumerate(events) if isinstance(e, DoneEvent | ErrorEvent)]
    if len(terminals) != 1:
        problems.append(f"{len(terminals)} terminal events")
    elif terminals[0] != len(events) - 1:
        problems.append("events after the terminal event")
    return problems


def check_outcome(
    record: JobRecord, result_text: str | None, *, after_poison: bool = False
) -> list[str]:
    """The ending fits the kind of job: an error code the guarantees allow, arq's result text
    equal to the deltas, a JSON answer that stopped is JSON. ``after_poison``: a poison
    request was sent before this job ended, so it may have shared both engines the poison
    killed and been quarantined with it (a known gap of #41): counted on its own
    (``Report.quarantined_bystanders``), not a problem."""
    terminal = record.terminal
    kind = record.spec.kind
    if isinstance(terminal, ErrorEvent):
        allowed = EXPECTED_CODES.get(kind, DEFAULT_EXPECTED_CODES)
        if record.gateway_cut:
            allowed = allowed | {"cancelled"}  # nobody listened: the worker abandons it
        if after_poison and kind != POISON_KIND:
            allowed = allowed | {"poison_job"}
        if terminal.code not in allowed:
            return [f"ended {terminal.code} ({kind} job): {terminal.message}"]
        return []
    if not isinstance(terminal, DoneEvent):
        return []  # check_events said so
    problems = []
    if result_text is not None and result_text != record.text:
        problems.append(
            f"arq result text ({len(result_text)} chars) differs from the deltas "
            f"({len(record.text)} chars)"
        )
    if kind == "json" and terminal.finish_reason == "stop":
        try:
            json.loads(record.text)
        except ValueError:
            problems.append(f"JSON answer that stopped does not parse: {record.text[:80]!r}")
    return problems


# --- the processes: Redis, supervised workers, the gateway --------------------------------------


@dataclass
class WorkerSlot:
    """One supervised worker: its current process and whether it serves."""

    name: str
    incarnation: int = 0
    worker: WorkerProcess | None = None
    ready: bool = False
    frozen: bool = False
    #: Set just before the harness kills it: that exit is no surprise.
    killed: bool = False

    @property
    def pid(self) -> int | None:
        process = None if self.worker is None else self.worker.process
        return None if process is None else process.pid


@dataclass
class Cluster:
    """Everything the campaign started, and how to put it back; ``close`` ends it all
    (after success, failure or Ctrl-C)."""

    workdir: Path
    model: Path
    workers: int
    gateway: bool
    lease_ttl_s: float
    outage_s: float
    tiny: bool
    redis: RedisServer = field(init=False)
    slots: list[WorkerSlot] = field(init=False)
    gateway_process: GatewayProcess | None = None
    #: Every engine process seen, as (pid, start time): none may outlive the campaign.
    engines: list[Any] = field(default_factory=list)
    #: Exits the harness did not cause, of workers that were serving: (slot, code, log tail).
    surprises: list[tuple[str, int | None, str]] = field(default_factory=list)
    closing: bool = False
    #: Ctrl-C: the workers' exit codes on the way out say nothing.
    closing_by_interrupt: bool = False
    gateway_starts: int = 0
    #: Each worker slot's link to Redis, by slot name (started in the campaign's event loop).
    links: dict[str, LinkProxy] = field(default_factory=dict)
    #: The workers get short stall settings (a campaign with ``freeze_engine``).
    engine_stall: bool = False
    #: The workers' engines die of the poison request (a campaign with ``poison``).
    poison: bool = False
    #: A poison request is out: a serving worker exiting 1 (its engine died) is no surprise.
    poisoning: bool = False
    #: The workers that exited so while a poison request was out, as ``name#incarnation``.
    poison_deaths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        data = self.workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        # TMPDIR of the workers, for their engine sockets: a short path of its own (a socket's
        # path must fit in 107 bytes, a work directory's may not), removed by close().
        self.tmpdir = Path(tempfile.mkdtemp(prefix="edgeq-chaos-"))
        self.redis = RedisServer(
            extra_args=("--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data))
        )
        self.slots = [WorkerSlot(f"worker-{i}") for i in range(self.workers)]

    @property
    def redis_url(self) -> str:
        return self.redis.url

    async def start_links(self) -> None:
        for slot in self.slots:
            self.links[slot.name] = await LinkProxy(self.redis.port).start()

    async def close_links(self) -> None:
        for link in self.links.values():
            await link.close()

    def worker_env(self, slot: WorkerSlot) -> dict[str, str]:
        link = self.links.get(slot.name)
        url = self.redis_url if link is None else f"redis://127.0.0.1:{link.port}/0"
        env = tiny_model_env(self.model, url, QUEUE) | {
            "EDGEQ_LEASE_TTL_S": str(self.lease_ttl_s),
            "EDGEQ_REDIS_OUTAGE_S": str(self.outage_s),
            "EDGEQ_DRAIN_TIMEOUT_S": "10",
            "EDGEQ_LOG_LEVEL": "info",
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(self.tmpdir),
        }
        if self.poison:
            env[POISON_ENV] = str(POISON_SEED)
        if self.engine_stall:
            env |= {
                "EDGEQ_ENGINE_STALL_S": str(CHAOS_ENGINE_STALL_S),
                "EDGEQ_ENGINE_STALL_EXIT_S": str(CHAOS_ENGINE_STALL_EXIT_S),
            }
        return env | (TINY_ENGINE_ENV if self.tiny else {})

    # --- workers ------------------------------------------------------------------------------

    def _spawn(self, slot: WorkerSlot) -> WorkerProcess:
        slot.incarnation += 1
        slot.killed = slot.ready = slot.frozen = False
        log = self.workdir / "logs" / f"{slot.name}.{slot.incarnation}.log"
        slot.worker = WorkerProcess(self.worker_env(slot), log).start()
        return slot.worker

    async def start_workers(self) -> None:
        """All workers at once (their engines load side by side), each ready."""
        started = [self._spawn(slot) for slot in self.slots]
        for slot, worker in zip(self.slots, started, strict=True):
            if not await self._wait_ready(worker):
                raise WorkerFailed(f"{slot.name} did not start:\n{worker.tail()}")
            self._serving(slot)

    async def _wait_ready(self, worker: WorkerProcess) -> bool:
        """Whether the worker became ready (False: it exited, timed out, or the campaign is
        closing). Polled on the event loop, not in a thread: Ctrl-C must not wait for it."""
        deadline = time.monotonic() + DEFAULT_READY_TIMEOUT_S
        while not self.closing and time.monotonic() < deadline:
            if worker._find_ready_event() is not None:
                return True
            if worker.process is None or worker.process.poll() is not None:
                return False
            await asyncio.sleep(0.2)
        return False

    def _serving(self, slot: WorkerSlot) -> None:
        from edgeq.worker.engine_processes import engine_pids, identify

        slot.ready = True
        if slot.pid is not None:
            self.engines.extend(identify(engine_pids(slot.pid)))

    async def supervise(self, slot: WorkerSlot) -> None:
        """Restart the slot's worker RESTART_DELAY_S after it exits, as systemd would."""
        while not self.closing:
            worker = slot.worker
            if worker is not None and worker.process is not None:
                code = worker.process.poll()
                if code is None:
                    # Ready after _wait_ready gave up on it: still starting, and serving now
                    # (an engine build took 334 s while the other engine held the same core,
                    # in a 30-minute run; it was never counted as serving again).
                    if not slot.ready and worker._find_ready_event() is not None:
                        self._serving(slot)
                    await asyncio.sleep(0.2)
                    continue
                if self.poisoning and code == EXIT_JOB_FAILED:
                    self.poison_deaths.append(f"{slot.name}#{slot.incarnation}")
                elif slot.ready and not slot.killed and not self.closing:
                    self.surprises.append((slot.name, code, worker.tail(20)))
            slot.ready = False
            await asyncio.sleep(RESTART_DELAY_S)
            if self.closing:
                return
            worker = self._spawn(slot)
            if await self._wait_ready(worker):
                self._serving(slot)
            # else: it exited (e.g. Redis away at start-up) and is started again

    def ready_slots(self) -> list[WorkerSlot]:
        return [slot for slot in self.slots if slot.ready and not slot.frozen]

    def kill_worker(self, slot: WorkerSlot) -> None:
        """SIGKILL to the worker's pid alone, as the OOM killer would: nobody kills its tree."""
        from edgeq.worker.engine_processes import engine_pids, identify

        assert slot.pid is not None
        self.engines.extend(identify(engine_pids(slot.pid)))
        slot.killed = True
        os.kill(slot.pid, signal.SIGKILL)

    async def freeze_engine(self, slot: WorkerSlot) -> tuple[int | None, float]:
        """SIGSTOP the worker's engine processes only, as a hung GPU leaves them, and wait for
        the worker to end itself; its exit code (None: it did not) and how long it took."""
        from edgeq.worker.engine_processes import engine_pids, identify

        assert slot.pid is not None and slot.worker is not None
        pids = engine_pids(slot.pid)
        self.engines.extend(identify(pids))
        slot.killed = True  # an exit the harness caused: no surprise
        started = time.monotonic()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = started + CHAOS_ENGINE_STALL_S + CHAOS_ENGINE_STALL_EXIT_S
        deadline += STALLED_EXIT_GRACE_S
        process = slot.worker.process
        try:
            # Polled on the event loop, not waited for in a thread: Ctrl-C must not wait.
            while time.monotonic() < deadline:
                if process is None or process.poll() is not None:
                    break
                await asyncio.sleep(0.2)
        finally:
            for pid in pids:  # the worker kills them; resumed in case it did not
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        code = process.poll() if process is not None else None
        if code is None:
            slot.killed = False  # it serves on: a later exit of its own is a surprise again
        return code, time.monotonic() - started

    def freeze_worker(self, slot: WorkerSlot, frozen: bool) -> None:
        """SIGSTOP (or SIGCONT) the worker and its engine processes: a stalled box."""
        if slot.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(slot.pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        slot.frozen = frozen

    def stop_workers(self) -> list[str]:
        """SIGTERM every worker and wait for it; the problems found (exit codes)."""
        problems = []
        for slot in self.slots:
            self.freeze_worker(slot, False)
            if slot.worker is None or slot.worker.process is None:
                continue
            if slot.worker.process.poll() is None:
                serving = slot.ready
                code = slot.worker.stop(signal.SIGTERM)
                # One still starting has no signal handler yet: SIGTERM simply ends it.
                if code != 0 and serving and not self.closing_by_interrupt:
                    problems.append(f"{slot.name} exited {code} on SIGTERM")
            else:
                slot.worker.stop(signal.SIGKILL)  # reap it, and its process group
        return problems

    # --- Redis --------------------------------------------------------------------------------

    def redis_down(self, how: str) -> None:
        process = self.redis.process
        assert process is not None
        process.send_signal(signal.Signals[how])
        process.wait(timeout=60)
        self.redis.process = None

    def redis_up(self) -> None:
        self.redis.start()  # the same port and data directory: the append-only file is read

    # --- the gateway --------------------------------------------------------------------------

    async def start_gateway(self) -> None:
        # EDGEQ_MODEL as the workers have it, as one env file on a box gives both: without
        # it the gateway knew the model only from live workers' heartbeats, and answered 404
        # to chats sent while every worker was restarting or Redis had just come back.
        env = {"EDGEQ_REDIS_URL": self.redis_url, "EDGEQ_QUEUE": QUEUE,
               "EDGEQ_MODEL": str(self.model)}  # fmt: skip
        self.gateway_starts += 1
        log = self.workdir / "logs" / f"gateway.{self.gateway_starts}.log"
        process = GatewayProcess(env, log)
        if self.gateway_process is not None:
            process.port = self.gateway_process.port  # clients keep their URL
        self.gateway_process = process
        await asyncio.to_thread(process.start)

    async def supervise_gateway(self) -> None:
        while not self.closing:
            process = self.gateway_process
            if process is not None and process.process is not None:
                if process.process.poll() is None:
                    await asyncio.sleep(0.2)
                    continue
            await asyncio.sleep(RESTART_DELAY_S)
            if not self.closing:
                with contextlib.suppress(RuntimeError):
                    await self.start_gateway()

    def kill_gateway(self) -> None:
        if self.gateway_process is not None and self.gateway_process.process is not None:
            self.gateway_process.process.kill()

    # --- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop whatever still runs; safe to call twice, and after a failed start."""
        self.closing = True
        self.stop_workers()
        if self.gateway_process is not None:
            self.gateway_process.stop()
        self.redis.stop()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def job_trail(self, job_id: str) -> list[str]:
        """What the workers logged about a job, in order: for a problem's report."""
        trail = []
        for log in sorted((self.workdir / "logs").glob("worker-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if job_id in line and line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        trail.append(
                            f"{log.stem} {event.get('timestamp', '')} {event.get('event')}"
                            f" {event.get('code') or event.get('finish_reason') or ''}"
                        )
        return trail


# --- the campaign ------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    """A fault as injected: seconds after load started."""

    kind: str
    start_s: float
    end_s: float
    detail: str


@dataclass
class Report:
    seed: int
    duration_s: float
    wall_s: float = 0.0
    accepted: int = 0
    done: int = 0
    continued: int = 0
    cancelled: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    gateway_cut: int = 0
    results_missing: int = 0
    #: Workload chats quarantined with a poison request (they shared both engines it killed:
    #: a known gap of #41), by job id; not in ``failed``, not problems.
    quarantined_bystanders: list[str] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    skipped_faults: list[str] = field(default_factory=list)
    ttft_ms: dict[str, dict[str, float | int]] = field(default_factory=dict)
    problems: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        lines = [
            f"chaos campaign, seed {self.seed}: {self.duration_s:g} s of load, "
            f"{self.wall_s:.0f} s wall",
            f"  jobs accepted {self.accepted}: done {self.done} (continued {self.continued}), "
            f"cancelled {self.cancelled}, failed {dict(sorted(self.failed.items()))}",
            f"  by kind {dict(sorted(self.by_kind.items()))}",
            f"  refused at the door {dict(sorted(self.refused.items()))}; "
            f"gateway streams cut {self.gateway_cut}; arq results missing {self.results_missing}",
            f"  chats quarantined with a poison request (bystanders) "
            f"{len(self.quarantined_bystanders)}: {self.quarantined_bystanders}",
            f"  faults injected {len(self.faults)}:",
            *(
                f"    {f.kind:<14} {f.start_s:7.1f} -> {f.end_s:7.1f} s  {f.detail}"
                for f in self.faults
            ),
            *(f"    skipped: {why}" for why in self.skipped_faults),
            "  TTFT (ms): "
            + "; ".join(
                f"{where} n={t['n']} p50 {t['p50']:.0f} p99 {t['p99']:.0f}"
                for where, t in self.ttft_ms.items()
            ),
            f"  problems: {len(self.problems)}",
            *(f"    {json.dumps(p)}" for p in self.problems[:50]),
        ]
        return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def windows_of(start_s: float, end_s: float, faults: Sequence[FaultRecord]) -> list[str]:
    """The faults whose window (plus RECOVERY_S) overlaps [start_s, end_s]."""
    return [
        f"{f.kind}@{f.start_s:.1f}"
        for f in faults
        if start_s <= f.end_s + RECOVERY_S and f.start_s <= end_s
    ]


@dataclass
class Campaign:
    cluster: Cluster
    seed: int
    duration_s: float
    in_flight: int
    fault_kinds: Sequence[str]
    report: Report = field(init=False)
    records: list[JobRecord] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    faults: list[FaultRecord] = field(default_factory=list)
    general_problems: list[str] = field(default_factory=list)
    t0: float = 0.0
    #: The campaign's ChatClient (set by ``run``): the poison fault submits through it.
    client: Any = None
    #: When the first poison request was sent (seconds after load started), if one was.
    poison_sent_s: float | None = None

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def run(self) -> Report:
        from edgeq.producer.client import ChatClient

        started = time.monotonic()
        self.report = Report(self.seed, self.duration_s)
        cluster = self.cluster
        cluster.redis.start()
        await cluster.start_links()
        await cluster.start_workers()
        supervisors = [asyncio.create_task(cluster.supervise(slot)) for slot in cluster.slots]
        if cluster.gateway:
            await cluster.start_gateway()
            supervisors.append(asyncio.create_task(cluster.supervise_gateway()))
        client = ChatClient(
            redis_url=cluster.redis_url,
            queue=QUEUE,
            lease_ttl_s=cluster.lease_ttl_s,
            client_max_connections=2 * self.in_flight + 2,
        )
        self.client = client
        self.t0 = time.monotonic()
        counter = itertools.count()
        try:
            lanes = [
                asyncio.create_task(self._lane(client, counter)) for _ in range(self.in_flight)
            ]
            faults = asyncio.create_task(self._inject_faults())
            await faults
            # Load ends at duration_s; the jobs then running get LANES_DRAIN_S to end.
            ended, late = await asyncio.wait(
                lanes, timeout=max(0.0, self.duration_s - self.now()) + LANES_DRAIN_S
            )
            for lane in late:
                lane.cancel()
            for lane in ended:
                if (error := lane.exception()) is not None:  # a bug of the harness itself
                    self.general_problems.append(f"a driver lane failed: {error!r}")
            for record in self.records:
                if record.terminal is None and not record.problems:
                    record.problems.append("no terminal event by the end of the drain")
            # A worker killed late is serving again before the end, as under systemd: its
            # restart also removes the dead one's engine socket directory.
            await self._all_serving()
            await self._quiet_drain(client)
        finally:
            cluster.closing = True
            for task in supervisors:
                task.cancel()
            await asyncio.gather(*supervisors, return_exceptions=True)
            await client.aclose()
            # The workers still run: they lose Redis here, and close() stops them at once.
            await cluster.close_links()
        self._final_checks()
        self.report.wall_s = time.monotonic() - started
        return self._summarize()

    # --- load ---------------------------------------------------------------------------------

    async def _lane(self, client: Any, counter: itertools.count[int]) -> None:
        """Keep one chat in flight until the load ends."""
        while self.now() < self.duration_s:
            spec = job_spec(self.seed, next(counter), gateway=self.cluster.gateway)
            if spec.via_gateway:
                await self._gateway_job(client, spec)
            else:
                await self._client_job(client, spec)

    async def _client_job(self, client: Any, spec: JobSpec) -> None:
        submitted = self.now()
        try:
            job = await client.submit(spec.prompt, **spec.fields)
        except (RedisUnavailable, QueueFull) as error:
            self.refused[type(error).__name__] += 1
            await asyncio.sleep(REFUSED_BACKOFF_S)
            return
        except EdgeqError as error:  # the harness built a request edgeq refuses
            self.general_problems.append(f"job {spec.index} ({spec.kind}) refused: {error}")
            await asyncio.sleep(REFUSED_BACKOFF_S)
            return
        record = JobRecord(spec, job.job_id, submitted)
        self.records.append(record)
        await self._read(client, record, job)
        await self._verify(client, record)

    async def _read(self, client: Any, record: JobRecord, job: Any) -> None:
        """Read the job's stream to its end, cancelling it mid-way for a ``cancel`` job."""
        canceller: asyncio.Task[None] | None = None
        try:
            async for event in job.stream():
                record.events.append(event)
                if record.first_delta_s is None and isinstance(event, DeltaEvent):
                    record.first_delta_s = self.now()
                    if record.spec.cancel_after_s is not None:
                        canceller = asyncio.create_task(
                            self._cancel_later(job, record.spec.cancel_after_s)
                        )
        except (RedisUnavailable, JobTimeout, StreamBroken, EdgeqError) as error:
            # The guarantee: an accepted job's reader rides out an outage until
            # EDGEQ_STREAM_TIMEOUT_S; nothing else may end its stream.
            record.problems.append(f"the stream raised {type(error).__name__}: {error}")
        finally:
            record.ended_s = self.now()
            if canceller is not None:
                canceller.cancel()
                await asyncio.gather(canceller, return_exceptions=True)

    async def _cancel_later(self, job: Any, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        with contextlib.suppress(RedisUnavailable):  # Redis away: the job runs to its end
            await job.cancel()

    async def _gateway_job(self, client: Any, spec: JobSpec) -> None:
        """The job through the gateway's streaming chat completions; its stream is then
        checked from the replay buffer, like any other (the gateway is a producer)."""
        import httpx

        gateway = self.cluster.gateway_process
        assert gateway is not None
        fields = {k: v for k, v in spec.fields.items() if k not in ("tenant", "deadline_s")}
        body = {
            "model": str(self.cluster.model),
            "messages": [{"role": "user", "content": spec.prompt}],
            "stream": True,
            **fields,
        }
        headers = {"X-Edgeq-Tenant": spec.fields["tenant"]}
        submitted = self.now()
        job_id = None
        content: list[str] = []
        finished = False
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=130.0)) as http,
                http.stream(
                    "POST", f"{gateway.base_url}/chat/completions", json=body, headers=headers
                ) as response,
            ):
                job_id = response.headers.get("X-Edgeq-Job-Id")
                if job_id is None:
                    body_text = (await response.aread()).decode(errors="replace")
                    if response.status_code not in REFUSALS_AT_THE_DOOR:
                        self.general_problems.append(
                            f"the gateway answered {response.status_code} at "
                            f"{submitted:.1f} s: {body_text[:300]}"
                        )
                    self.refused[f"gateway_{response.status_code}"] += 1
                    await asyncio.sleep(REFUSED_BACKOFF_S)
                    return
                # An error status with a job id: the job was accepted and ended before its
                # first token, and the gateway answered its error (a poison_job bystander,
                # say); it is checked from its replay buffer like every other job.
                finished = response.status_code != 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        finished |= line == "data: [DONE]"
                        continue
                    for choice in json.loads(line[6:]).get("choices", ()):
                        content.append(choice.get("delta", {}).get("content") or "")
        except (httpx.HTTPError, ValueError):
            if job_id is None:
                self.refused["gateway_unreachable"] += 1
                await asyncio.sleep(REFUSED_BACKOFF_S)
                return
        assert job_id is not None
        record = JobRecord(spec, job_id, submitted, gateway_cut=not finished)
        self.records.append(record)
        # Follow the job to its end from the replay buffer (it goes on without the gateway).
        job = await self._with_redis(lambda: client.attach(job_id))
        if job is None:
            record.problems.append("could not attach to the job: Redis away too long")
            return
        await self._read(client, record, job)
        await self._verify(client, record)
        done = isinstance(record.terminal, DoneEvent)
        if finished and done and spec.kind != "json" and "".join(content) != record.text:
            record.problems.append("the gateway's content differs from the job's deltas")

    # --- checks -------------------------------------------------------------------------------

    async def _with_redis(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``, tried again while Redis is away (a fault window), up to
        REDIS_PATIENCE_S; None if it never came back."""
        deadline = time.monotonic() + REDIS_PATIENCE_S
        while True:
            try:
                with redis_errors(self.cluster.redis_url):
                    return await call()
            except RedisUnavailable:
                if time.monotonic() > deadline:
                    return None
                await asyncio.sleep(0.5)

    async def _verify(self, client: Any, record: JobRecord) -> None:
        """What the reader saw is the stream Redis kept, and it ends as the guarantees say."""
        record.problems.extend(check_events(record.events, record.job_id))
        if record.terminal is None:
            return
        kept = await self._with_redis(lambda: read_events(client.redis, record.job_id))
        if kept is None:
            record.problems.append("the replay buffer could not be read: Redis away too long")
        elif kept != record.events:
            record.problems.append(
                f"the live stream ({len(record.events)} events) differs from the replay buffer "
                f"({len(kept)} events)"
            )
        result_text = None
        if isinstance(record.terminal, DoneEvent):
            result_text = await self._result_text(client, record.job_id)
            if result_text is None:
                self.report.results_missing += 1
        after_poison = self.poison_sent_s is not None
        record.problems.extend(check_outcome(record, result_text, after_poison=after_poison))

    async def _result_text(self, client: Any, job_id: str) -> str | None:
        """The text of arq's result record (kept EDGEQ_KEEP_RESULT_S), or None if none came."""
        deadline = time.monotonic() + RESULT_WAIT_S
        while time.monotonic() < deadline:
            raw = await self._with_redis(lambda: client.redis.get(result_key(job_id)))
            if raw is not None:
                result = json.loads(raw).get("r")
                return result.get("text") if isinstance(result, dict) else None
            await asyncio.sleep(0.2)
        return None

    async def _all_serving(self) -> None:
        deadline = time.monotonic() + DEFAULT_READY_TIMEOUT_S
        while not all(slot.ready for slot in self.cluster.slots):
            if time.monotonic() > deadline:
                self.general_problems.append("a restarted worker never became ready again")
                return
            await asyncio.sleep(0.5)

    async def _quiet_drain(self, client: Any) -> None:
        """With no load left, nothing may stay queued, leased or marked in progress."""
        deadline = time.monotonic() + QUIET_DRAIN_S
        left: list[str] = []
        while time.monotonic() < deadline:
            left = await self._with_redis(lambda: self._left_over(client)) or []
            if not left:
                return
            await asyncio.sleep(1.0)
        self.general_problems.append(f"left queued, leased or in progress: {left[:20]}")
        records = {record.job_id: record for record in self.records}
        for entry in left[:5]:
            job_id = entry.rsplit(" ", 1)[1]
            record = records.get(job_id)
            seen = [f"{e.seq}:{e.type}" for e in record.events][-3:] if record else "not ours"
            self.general_problems.append(
                f"left {job_id}: the client saw {seen}; "
                f"the workers logged {self.cluster.job_trail(job_id)}"
            )

    async def _left_over(self, client: Any) -> list[str]:
        redis = client.redis
        queued = [f"queued {j.decode()}" for j in await redis.zrange(QUEUE, 0, -1)]
        leased = [f"leased {j.decode()}" for j in await redis.zrange(leases_key(QUEUE), 0, -1)]
        prefix = in_progress_key("")  # arq's in-progress keys, as core/keys.py names them
        marked = [
            f"in progress {key.decode().removeprefix(prefix)}"
            async for key in redis.scan_iter(match=f"{prefix}*", count=1000)
        ]
        return queued + leased + marked

    def _final_checks(self) -> None:
        """After the workers stopped: no engine process and no engine socket directory left,
        and no worker that died on its own."""
        from edgeq.worker.engine_processes import wait_until_gone

        cluster = self.cluster
        self.general_problems.extend(cluster.stop_workers())
        left = wait_until_gone(cluster.engines, timeout_s=ENGINE_GONE_S)
        if left:
            self.general_problems.append(f"engine processes left behind: {left}")
        sockets = sorted(p.name for p in cluster.tmpdir.glob("edgeq-engine-*"))
        if sockets:
            self.general_problems.append(f"engine socket directories left: {sockets}")
        for name, code, tail in cluster.surprises:
            self.general_problems.append(f"{name} exited {code} on its own:\n{tail}")

    # --- faults -------------------------------------------------------------------------------

    async def _inject_faults(self) -> None:
        kinds = [k for k in self.fault_kinds if k != "kill_gateway" or self.cluster.gateway]
        plan = fault_schedule(
            self.seed,
            self.duration_s,
            kinds,
            lease_ttl_s=self.cluster.lease_ttl_s,
            outage_s=self.cluster.outage_s,
        )
        ended_at: float | None = None
        for fault in plan:
            await asyncio.sleep(max(0.0, fault_start_s(fault, ended_at) - self.now()))
            await self._inject(fault)
            ended_at = self.now()

    async def _victim(self, fault: Fault) -> WorkerSlot | None:
        """A serving worker, picked by the plan's ``target``; waits for one (a restart)."""
        deadline = time.monotonic() + 300
        while not (ready := self.cluster.ready_slots()):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)
        return ready[fault.target % len(ready)]

    async def _inject(self, fault: Fault) -> None:
        cluster = self.cluster
        start = self.now()
        detail = ""
        if fault.kind in ("kill_worker", "stop_worker", "slow_link", "drop_link", "freeze_engine"):
            slot = await self._victim(fault)
            if slot is None:
                self.report.skipped_faults.append(f"{fault.kind} at {start:.1f}: no worker ready")
                return
            start = self.now()
            detail = f"{slot.name}#{slot.incarnation} pid {slot.pid}"
            if fault.kind == "kill_worker":
                cluster.kill_worker(slot)
            elif fault.kind == "freeze_engine":
                loaded = self.now() < self.duration_s
                code, took_s = await cluster.freeze_engine(slot)
                detail += f", engine frozen: worker exited {code} after {took_s:.1f} s"
                if code is None and not loaded:
                    # An idle engine makes no steps and is never stalled (worker/liveness.py):
                    # frozen after the load ended, it may get no work to stall on.
                    detail += " (the load had ended: no work to stall on)"
                elif code != EXIT_ENGINE_STALLED:
                    self.general_problems.append(
                        f"{slot.name}: its engine frozen, the worker exited {code} after "
                        f"{took_s:.1f} s, not {EXIT_ENGINE_STALLED} (worker/liveness.py)"
                    )
            elif fault.kind in ("slow_link", "drop_link"):
                link = cluster.links[slot.name]
                if fault.kind == "slow_link":
                    link.slow(fault.delay_s)
                    detail += f", {fault.delay_s * 1000:.0f} ms each way for {fault.hold_s:g} s"
                else:
                    link.stall()
                    detail += f", cut {fault.hold_s:g} s (lease {cluster.lease_ttl_s:g} s)"
                try:
                    await asyncio.sleep(fault.hold_s)
                finally:
                    link.heal()
            else:
                cluster.freeze_worker(slot, True)
                try:
                    await asyncio.sleep(fault.hold_s)
                finally:
                    cluster.freeze_worker(slot, False)
                detail += f", stopped {fault.hold_s:g} s (lease {cluster.lease_ttl_s:g} s)"
        elif fault.kind in ("restart_redis", "redis_outage"):
            how = fault.how or "SIGTERM"
            await asyncio.to_thread(cluster.redis_down, how)
            try:
                await asyncio.sleep(fault.hold_s)
            finally:
                await asyncio.to_thread(cluster.redis_up)
            detail = f"{how}, away {fault.hold_s:g} s (outage limit {cluster.outage_s:g} s)"
        elif fault.kind == "kill_gateway":
            cluster.kill_gateway()
        elif fault.kind == "poison":
            await self._all_serving()  # its continuation needs a second engine to reach
            start = self.now()
            detail = await self._poison()
        self.faults.append(FaultRecord(fault.kind, start, self.now(), detail))

    async def _poison(self) -> str:
        """Send a request that kills every engine that steps it and follow it to its end: it
        must end ``poison_job`` after two engine deaths (never a third), be in the dead-letter
        set, and be refused at the door when sent again. Its record joins the workload's (kind
        ``poison``), so the campaign's own checks hold for it too."""
        cluster, client = self.cluster, self.client
        fields = {"tenant": TENANTS[0], "seed": POISON_SEED, "max_tokens": POISON_MAX_TOKENS}
        # A prompt of its own each time: the same request again would be refused at the door
        # (its fingerprint is quarantined), and every poison fault must reach the engines.
        sent = sum(fault.kind == "poison" for fault in self.faults)
        spec = JobSpec(-1, POISON_KIND, f"chaos poison {sent}: a request built to kill", fields)
        seen = len(cluster.poison_deaths)
        cluster.poisoning = True
        try:
            try:
                job = await self._with_redis(lambda: client.submit(spec.prompt, **spec.fields))
            except EdgeqError as error:
                self.general_problems.append(f"the poison request was refused: {error}")
                return "not sent"
            if job is None:
                self.general_problems.append("the poison request was not sent: Redis away")
                return "not sent"
            self.poison_sent_s = self.now()
            record = JobRecord(spec, job.job_id, self.poison_sent_s)
            self.records.append(record)
            await self._read(client, record, job)
            await self._verify(client, record)
            # Each engine death is counted on the job before its worker exits 1.
            deadline = time.monotonic() + POISON_DEATHS_S
            while len(cluster.poison_deaths) - seen < POISON_AFTER_ENGINE_FAILURES:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            return await self._check_poison(record, cluster.poison_deaths[seen:])
        finally:
            cluster.poisoning = False

    async def _check_poison(self, record: JobRecord, deaths: list[str]) -> str:
        """What #41 promises of a poison request that ended; the fault's detail."""
        client, job_id = self.client, record.job_id
        failures = await self._with_redis(lambda: engine_failures(client.redis, job_id))
        letter = await self._with_redis(lambda: read_dead_letter(client.redis, QUEUE, job_id))
        if len(deaths) > POISON_AFTER_ENGINE_FAILURES or failures != POISON_AFTER_ENGINE_FAILURES:
            record.problems.append(
                f"the poison request cost {len(deaths)} worker exits ({deaths}) and was running "
                f"at {failures} engine failures, not {POISON_AFTER_ENGINE_FAILURES}"
            )
        if letter is None:
            record.problems.append("the poison request is not in the dead-letter set")
        try:
            again = await self._with_redis(
                lambda: client.submit(record.spec.prompt, **record.spec.fields)
            )
        except PoisonRefused:
            refused = "refused at the door"
        else:
            refused = "ACCEPTED again"
            record.problems.append("the poison request sent again was accepted, not refused")
            if again is not None:
                await again.cancel("the campaign's poison request must not run again")
                await again.aclose()
        code = getattr(record.terminal, "code", None)
        return (
            f"{job_id}: ended {code}, {failures} engine failures, workers exited "
            f"{', '.join(deaths) or 'none'}; dead letter {'kept' if letter else 'MISSING'}; "
            f"sent again: {refused}"
        )

    # --- the report -----------------------------------------------------------------------------

    def _summarize(self) -> Report:
        report = self.report
        report.faults = self.faults
        report.refused = dict(self.refused)
        report.accepted = len(self.records)
        ttft: dict[str, list[float]] = {"outside faults": [], "inside faults": []}
        kinds: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        for record in self.records:
            kinds[record.spec.kind] += 1
            report.gateway_cut += record.gateway_cut
            terminal = record.terminal
            if isinstance(terminal, DoneEvent):
                report.done += 1
                report.continued += bool(terminal.continued)
            elif isinstance(terminal, ErrorEvent):
                if terminal.code == "cancelled":
                    report.cancelled += 1
                elif terminal.code == "poison_job" and record.spec.kind != POISON_KIND:
                    report.quarantined_bystanders.append(record.job_id)
                else:
                    failed[terminal.code] += 1
            if record.first_delta_s is not None:
                inside = windows_of(record.submitted_s, record.first_delta_s, self.faults)
                ttft["inside faults" if inside else "outside faults"].append(
                    (record.first_delta_s - record.submitted_s) * 1000
                )
            for problem in record.problems:
                report.problems.append(
                    {
                        "job_id": record.job_id,
                        "kind": record.spec.kind,
                        "problem": problem,
                        "fault_windows": windows_of(
                            record.submitted_s, record.ended_s or self.now(), self.faults
                        ),
                    }
                )
        report.problems.extend({"job_id": None, "problem": p} for p in self.general_problems)
        report.failed = dict(failed)
        report.by_kind = dict(kinds)
        report.ttft_ms = {
            where: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)}
            for where, v in ttft.items()
        }
        return report


# --- the command -------------------------------------------------------------------------------


def run_chaos_command(
    *,
    duration_s: float,
    seed: int,
    workers: int,
    in_flight: int,
    model: Path | None,
    gateway: bool,
    out: Path | None,
    workdir: Path | None,
    lease_ttl_s: float,
    outage_s: float,
    faults: Sequence[str],
) -> int:
    """Run one campaign; print the report (and write it to ``out``); 0 when no problem."""
    from edgeq.exit_codes import EXIT_OK

    own_dir = workdir is None
    # A short path: vLLM's socket paths under it must stay within 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="edgeq-chaos-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    tiny = model is None
    if model is None:
        from edgeq.testing.tiny_model import make_tiny_model

        model = make_tiny_model(root / "tiny-model").directory
    cluster = Cluster(root, model, workers, gateway, lease_ttl_s, outage_s, tiny,
                      engine_stall="freeze_engine" in faults,
                      poison="poison" in faults)  # fmt: skip
    campaign = Campaign(cluster, seed, duration_s, in_flight, faults)
    print(f"chaos: seed {seed}, {duration_s:g} s, {workers} workers, {in_flight} in flight, "
          f"logs in {root}/logs", flush=True)  # fmt: skip
    report: Report | None = None
    try:
        report = asyncio.run(campaign.run())
    except KeyboardInterrupt:
        cluster.closing_by_interrupt = True
        print("chaos: interrupted; stopping everything it started", file=sys.stderr)
        raise
    finally:
        cluster.close()
    print(report.render(), flush=True)
    if out is not None:
        out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if report.problems:
        print(f"chaos: {len(report.problems)} problems; logs kept in {root}/logs")
        return 1
    if own_dir:
        shutil.rmtree(root, ignore_errors=True)
    return EXIT_OK
