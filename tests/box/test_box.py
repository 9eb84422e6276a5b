"""An operator's day on a box, under a real systemd: a booted systemd-nspawn container (one per
module, tests/box/nspawn_box.py), the real CPU bundle with the tiny model and the real
install.sh, its systemd branch. No fakes: the container's own redis-server.service with
redis-edgeq.conf, the units as installed, journald, the watchdog, the start limit, the drain.

The tests share the box and run in file order, as an operator's day would:
install -> status and journal -> a producer's chat -> SIGKILL mid-stream -> watchdog ->
stop with chats in flight -> a bad setting -> a unit crashing on start -> upgrade with the
gateway -> the gateway's OpenAI API -> sandboxing -> rollback -> uninstall and purge.

Two unit settings are shortened by drop-ins, never by editing the installed unit, only where
waiting for the shipped value would cost minutes and prove nothing more: WatchdogSec=20s
(120 s shipped) for the watchdog test, RestartSec=1s for the unit that crashes on start (the
start limit itself, 4 starts in 20 min, is the shipped one).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime

import pytest
from nspawn_box import PATH, Box, monotonic_us

from edgeq.core.keys import terminal_key
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, StreamEvent
from edgeq.producer.client import ChatClient
from edgeq.testing.engine_hold import HOLD_ENV, EngineHold
from helpers import FIGURES, assert_intact

pytestmark = [pytest.mark.box, pytest.mark.engine, pytest.mark.timeout(900)]

WORKER = "edgeq-worker@cpu.service"  # a box without a GPU gets the CPU instance
GATEWAY = "edgeq-gateway.service"
TARGET = "edgeq.target"
QUEUE = "edgeq:queue"
RELEASE = "0.1.0"
LONG = 300  # tokens: still generating when something happens (tests/chaos)
KILLED_TOKENS = 1500  # the chat killed mid-stream: seconds of work left for the restart
FULL_LENGTH_SEED = 10  # helpers.FULL_LENGTH_SEEDS[0]: no end-of-turn within LONG tokens
RESTART_SEC = 15  # the unit's RestartSec=
LEASE_TTL_S = 10  # EDGEQ_LEASE_TTL_S's default
DRAIN_TIMEOUT_S = 30  # EDGEQ_DRAIN_TIMEOUT_S's default
WATCHDOG_S = 20  # the drop-in's WatchdogSec= (shipped: 120 s)
ENGINE_START_TIMEOUT_S = 600  # a 2-core machine shared with other test runs
DROPINS = "/etc/systemd/system/edgeq-worker@cpu.service.d"
# The test hold of every worker instance's engine (edgeq.testing.engine_hold, in the wheel).
HOLD_DROPINS = "/etc/systemd/system/edgeq-worker@.service.d"
HOLD_INSIDE = "/var/lib/edgeq/test-engine-hold"
BAD_SETTING = "EDGEQ_MAX_NUM_SEQS=lots"
ACTIVE_AT = "ActiveEnterTimestampMonotonic"


# --- helpers ---------------------------------------------------------------------------------


def install(box: Box, bundle: str, *args: str, timeout: float = 1200) -> str:
    """``./install.sh ARGS`` in the unpacked bundle, as root; its output (it must succeed)."""
    command = f"cd {shlex.quote(bundle)} && ./install.sh {shlex.join(args)} 2>&1"
    return box.run(command, timeout=timeout).stdout


def redis_password(box: Box) -> str:
    env = (box.root / "etc/edgeq/edgeq.env").read_text()
    (password,) = re.findall(r"(?m)^EDGEQ_REDIS_URL=redis://:([0-9a-f]+)@127\.0\.0\.1:6379/0$", env)
    return password


def max_continuations() -> int:
    """EDGEQ_MAX_CONTINUATIONS's default in the edgeq the bundles were built from (0 where
    that edgeq has no continuation: a killed worker's chat then ends with worker_lost)."""
    from edgeq.core import settings

    for value in vars(settings).values():
        fields = getattr(value, "model_fields", None)
        if isinstance(fields, dict) and "max_continuations" in fields:
            return int(fields["max_continuations"].default)
    return 0


def main_pid(box: Box) -> int:
    return int(box.show(WORKER, "MainPID")["MainPID"])


def events_of(entries: list[dict[str, str]]) -> list[dict[str, object]]:
    """The worker's structured events among journal entries (vLLM's own lines are text)."""
    events = []
    for entry in entries:
        message = entry.get("MESSAGE", "")
        if message.startswith("{"):
            try:
                events.append(json.loads(message) | {"_PID": entry.get("_PID")})
            except ValueError:
                pass
    return events


def systemd_lines(entries: list[dict[str, str]]) -> list[str]:
    """What systemd itself logged about the unit."""
    return [e["MESSAGE"] for e in entries if e.get("SYSLOG_IDENTIFIER") == "systemd"]


def utc_us(stamp: str) -> float:
    """A structlog ISO timestamp (``2026-12-01T12:22:18.137745Z``), as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def since_epoch(box: Box, unit: str, prop: str) -> float:
    """A unit's timestamp property, as seconds since the epoch."""
    out = box.run(f"systemctl show --timestamp=us+utc -p {prop} --value {unit}").stdout
    return datetime.strptime(out.strip() + " +0000", "%a %Y-%m-%d %H:%M:%S.%f UTC %z").timestamp()


def http_status(box: Box, url: str) -> int:
    """GET url from the container's network (curl of this machine), its status (0: none)."""
    result = subprocess.run(
        [*box.nsenter(net_only=True), "curl", "--noproxy", "*", "-s", "-o", "/dev/null",
         "-w", "%{http_code}", "--max-time", "3", url],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return int(result.stdout or 0)


async def first_delta(job) -> tuple[list[StreamEvent], AsyncIterator[StreamEvent]]:
    stream = job.stream()
    seen = [await anext(stream)]
    assert isinstance(seen[0], DeltaEvent), seen
    return seen, stream


async def rest_of(stream: AsyncIterator[StreamEvent], timeout_s: float = 120) -> list[StreamEvent]:
    async with asyncio.timeout(timeout_s):
        return [event async for event in stream]


def wait_ready_again(box: Box, old_pid: int, timeout_s: float = ENGINE_START_TIMEOUT_S) -> int:
    """Until a new main process is READY (active/running); its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = box.show(WORKER, "ActiveState", "SubState", "MainPID")
        if shown["ActiveState"] == "active" and int(shown["MainPID"]) not in (0, old_pid):
            return int(shown["MainPID"])
        time.sleep(0.5)
    raise AssertionError(f"{WORKER} not READY again after {timeout_s} s: {box.state(WORKER)}")


@pytest.fixture(scope="module", autouse=True)
def engine_hold(box: Box) -> EngineHold:
    """Written before install.sh starts the first worker: a drop-in that gives every worker
    instance's engine a test hold (``edgeq.testing.engine_hold``), armed only by a test that
    needs a chat still running when it acts. The SIGKILL test removes it once used."""
    box.run(
        f"mkdir -p {HOLD_DROPINS} && printf '[Service]\\nEnvironment={HOLD_ENV}={HOLD_INSIDE}\\n' "
        f">{HOLD_DROPINS}/box-test-hold.conf"
    )
    return EngineHold(box.root / HOLD_INSIDE.lstrip("/"))


@pytest.fixture
async def redis_port(box: Box) -> AsyncIterator[int]:
    """A port here forwarded to the box's 127.0.0.1:6379."""
    async with box.forward(6379) as port:
        yield port


@pytest.fixture
async def client(box: Box, redis_port: int) -> AsyncIterator[ChatClient]:
    """A producer outside the units, with the password install.sh wrote into edgeq.env, over
    TCP to the box's loopback Redis (as EDGEQ_REDIS_URL says)."""
    url = f"redis://:{redis_password(box)}@127.0.0.1:{redis_port}/0"
    async with ChatClient(redis_url=url, queue=QUEUE, lease_ttl_s=LEASE_TTL_S) as chat_client:
        yield chat_client


# --- 1. install.sh's systemd branch ----------------------------------------------------------


def test_install_sh_creates_the_user_release_units_and_redis_config_then_smoke_chats(
    box: Box,
) -> None:
    started = time.monotonic()
    out = install(box, box.bundles["v1"])
    FIGURES["box: first install.sh (venv, units, READY, smoke chat) (s)"] = round(
        time.monotonic() - started, 1
    )
    assert "systemd is not running here" not in out, out
    assert "+ system user edgeq" in out and "+ enabled edgeq-worker@cpu.service" in out, out
    assert f"waiting for {WORKER} to be ready (READY=1" in out, out
    assert "smoke test passed" in out, out

    # The user, from the sysusers.d file: a system account without a login.
    user = box.run("getent passwd edgeq").stdout.strip().split(":")
    assert int(user[2]) < 1000 and user[5] == "/var/lib/edgeq" and user[6] == "/usr/sbin/nologin"
    # The release, its current link; the state directory, owned by edgeq (StateDirectory=).
    assert box.run("readlink /opt/edgeq/current").stdout.strip() == f"releases/{RELEASE}"
    assert box.run("stat -c %U:%a /var/lib/edgeq").stdout.strip() == "edgeq:750"
    # Enabled: the target at boot, the instance in the target.
    enabled = box.run(f"systemctl is-enabled {TARGET} {WORKER}").stdout.split()
    assert enabled == ["enabled", "enabled"]
    assert box.state(WORKER) == "active/running"

    # The distribution's Redis under redis-edgeq.conf: a password, loopback, noeviction, AOF.
    assert "include /etc/redis/redis-edgeq.conf" in (box.root / "etc/redis/redis.conf").read_text()
    assert box.state("redis-server.service") == "active/running"
    denied = box.run("redis-cli -h 127.0.0.1 ping", check=False)
    assert "NOAUTH" in denied.stdout + denied.stderr
    password = redis_password(box)
    cli = f"REDISCLI_AUTH={password} redis-cli -h 127.0.0.1"
    config = box.run(f"{cli} config get '*'").stdout.split("\n")
    settings = dict(zip(config[0::2], config[1::2], strict=False))
    assert settings["bind"] == "127.0.0.1 -::1" and settings["protected-mode"] == "yes"
    assert settings["maxmemory-policy"] == "noeviction" and settings["appendonly"] == "yes"
    assert settings["maxmemory"] == str(1 << 30)
    listening = box.run("ss -Hltn 'sport = :6379'").stdout.split()
    addresses = {word.rsplit(":", 1)[0] for word in listening if word.endswith(":6379")}
    assert addresses and addresses <= {"127.0.0.1", "[::1]"}, listening

    # A second run changes nothing, under systemd too.
    again = install(box, box.bundles["v1"])
    assert "nothing changed" in again and "  + " not in again, again


# --- 2. status and journal -------------------------------------------------------------------


def test_active_only_after_ready_and_the_journal_has_structured_events(box: Box) -> None:
    status = box.run(f"systemctl status --no-pager {WORKER}").stdout
    assert "Active: active (running)" in status, status
    assert 'Status: "warm, serving edgeq:queue with /var/lib/edgeq/models/tiny-qwen3"' in status
    started = since_epoch(box, WORKER, "ExecMainStartTimestamp")
    active = since_epoch(box, WORKER, "ActiveEnterTimestamp")
    events = events_of(box.journal(WORKER))
    (ready,) = [e for e in events if e["event"] == "worker_ready"]
    # The worker logs worker_ready, then sends READY=1: only that makes the unit active.
    assert started < utc_us(str(ready["timestamp"])) <= active, (started, ready, active)
    FIGURES["box: unit start -> active (READY=1 after warm-up) (s)"] = round(active - started, 1)
    # The install's smoke chat, as structured events carrying its job id.
    done = [e for e in events if e["event"] == "job_done"]
    assert done and re.fullmatch(r"[0-9a-f]{32}", str(done[-1]["job_id"])), done
    job_events = {e["event"] for e in events if e.get("job_id") == done[-1]["job_id"]}
    assert {"job_started", "job_done"} <= job_events, job_events


# --- 3. a producer outside the unit ------------------------------------------------------------


async def test_a_producer_outside_the_unit_streams_a_chat_to_the_end(
    box: Box, client: ChatClient, redis_port: int
) -> None:
    job = await client.submit("Hello from a producer", max_tokens=32)
    events = [event async for event in job.stream()]
    assert_intact(events, job.job_id)
    assert isinstance(events[-1], DoneEvent) and events[-1].usage.completion_tokens > 0
    assert any(isinstance(e, DeltaEvent) for e in events)
    # The worker logs job_done after the done event is out, and journald stores the line a
    # moment later still: a read right after the stream ended may not have it yet.
    deadline = time.monotonic() + 10
    while True:
        logged = [e for e in events_of(box.journal(WORKER)) if e.get("job_id") == job.job_id]
        if {"job_started", "job_done"} <= {e["event"] for e in logged}:
            break
        assert time.monotonic() < deadline, logged
        await asyncio.sleep(0.2)
    # Without the password, Redis refuses the producer.
    async with ChatClient(redis_url=f"redis://127.0.0.1:{redis_port}/0", queue=QUEUE) as stranger:
        with pytest.raises(Exception, match=r"(?i)auth"):
            await stranger.submit("no password", max_tokens=4)


# --- 4. SIGKILL mid-stream -------------------------------------------------------------------


async def test_sigkill_mid_stream_restarts_the_unit_with_nothing_left_behind(
    box: Box, client: ChatClient, engine_hold: EngineHold
) -> None:
    before = box.cgroup_processes(WORKER)
    old_main = main_pid(box)
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(before.values()), before
    # The engine stops after the answer's first token, so the chat is still running at the
    # kill however fast the tiny model is or slow the machine. (Freezing the engine on the
    # first delta raced: three chats in a row of a loaded run had ended before the freeze.)
    engine_hold.arm(after_tokens=1)
    job = await client.submit("doomed", max_tokens=KILLED_TOKENS, seed=FULL_LENGTH_SEED)
    seen, stream = await first_delta(job)
    assert not await client.redis.exists(terminal_key(job.job_id))
    # SIGKILL to the main process only, as an OOM kill or a crash would: systemd must clean
    # up the rest of the cgroup (vLLM's engine processes) itself, then restart the unit.
    box.run(f"systemctl kill --kill-whom=main --signal=SIGKILL {WORKER}")
    killed_us = monotonic_us()
    engine_hold.release()
    assert box.wait_state(WORKER, "activating/auto-restart", timeout_s=10)
    # While it waits RestartSec: no process of the old worker is left, anywhere in the box.
    left = box.run("ps -eo pid=,comm=").stdout
    assert "VLLM::" not in left and str(old_main) not in left.split(), left
    # The watchdog test's drop-in, read by the restart that is due (not by a running worker);
    # the hold's drop-in goes: no later worker obeys a test hold.
    box.run(
        f"mkdir -p {DROPINS} && printf '[Service]\\nWatchdogSec={WATCHDOG_S}s\\n' "
        f">{DROPINS}/box-watchdog.conf && rm -r {HOLD_DROPINS} && systemctl daemon-reload"
    )

    async def to_the_end() -> tuple[list[StreamEvent], float]:
        rest = await rest_of(stream, ENGINE_START_TIMEOUT_S)
        return rest, (monotonic_us() - killed_us) / 1e6

    ending = asyncio.create_task(to_the_end())  # reads the stream while systemd restarts

    def restart() -> tuple[str, int]:
        """systemd restarts it after RestartSec; it is `activating` until READY=1."""
        state = box.state(WORKER)
        while state == "activating/auto-restart":
            time.sleep(0.2)
            state = box.state(WORKER)
        return state, wait_ready_again(box, old_main)

    first_state, new_main = await asyncio.to_thread(restart)
    assert first_state == "activating/start", first_state
    rest, ended_s = await ending
    terminal = rest[-1]
    assert_intact(seen + rest, job.job_id)
    # As the guarantees say: continued by the restarted worker in the same stream, since it is
    # back (RestartSec + engine start) within EDGEQ_CONTINUE_WITHIN_S; with continuations off,
    # ended with worker_lost, safe to submit again. Never both, never silence.
    if max_continuations() > 0:
        assert isinstance(terminal, DoneEvent) and terminal.continued == 1, terminal
        outcome = "continued by the restarted worker, done"
    else:
        assert isinstance(terminal, ErrorEvent) and terminal.code == "worker_lost", terminal
        assert "safe to submit it again" in terminal.message, terminal
        outcome = "worker_lost"
    FIGURES[f"box: SIGKILL mid-stream -> {outcome} after (s)"] = round(ended_s, 1)

    shown = box.show(
        WORKER, "NRestarts", "ExecMainStartTimestampMonotonic", "WatchdogUSec", ACTIVE_AT
    )
    restarted_s = (int(shown["ExecMainStartTimestampMonotonic"]) - killed_us) / 1e6
    assert RESTART_SEC - 1 <= restarted_s <= RESTART_SEC + 10, restarted_s
    assert shown["NRestarts"] == "1" and shown["WatchdogUSec"] == f"{WATCHDOG_S}s", shown
    after = box.cgroup_processes(WORKER)
    assert not set(after) & set(before), (before, after)
    assert sorted(after.values()).count("VLLM::EngineCore") == 1, after
    FIGURES["box: SIGKILL -> READY again (RestartSec + engine start) (s)"] = round(
        (int(shown[ACTIVE_AT]) - killed_us) / 1e6, 1
    )
    assert await client.chat("after the crash", max_tokens=4)
    assert new_main != old_main


# --- 5. the watchdog -------------------------------------------------------------------------


def test_a_frozen_worker_is_killed_by_the_watchdog_and_restarted(box: Box) -> None:
    frozen = main_pid(box)
    environ = box.run(f"tr '\\0' '\\n' </proc/{frozen}/environ").stdout.split()
    assert f"WATCHDOG_USEC={WATCHDOG_S * 1_000_000}" in environ
    since = monotonic_us()
    box.run(f"kill -STOP {frozen}")  # the event loop stops; so do its WATCHDOG=1 pings
    deadline = time.monotonic() + WATCHDOG_S + 30
    while box.show(WORKER, "Result")["Result"] != "watchdog":
        assert time.monotonic() < deadline, box.state(WORKER)
        time.sleep(0.5)
    fired_s = (monotonic_us() - since) / 1e6
    # The last ping came at most WatchdogSec/2 before the freeze.
    assert WATCHDOG_S / 2 - 2 <= fired_s <= WATCHDOG_S + 3, fired_s
    FIGURES[f"box: SIGSTOP -> watchdog (WatchdogSec={WATCHDOG_S}s) fired after (s)"] = round(
        fired_s, 1
    )
    new_main = wait_ready_again(box, frozen)
    entries = box.journal(WORKER, since_monotonic_us=since)
    lines = systemd_lines(entries)
    assert any("Watchdog timeout" in line for line in lines), lines
    assert any("SIGABRT" in line for line in lines), lines
    # PYTHONFAULTHANDLER=1: the stack of the stuck worker is in the journal.
    messages = [e["MESSAGE"] for e in entries if e.get("_PID") == str(frozen)]
    assert any("Fatal Python error: Aborted" in m for m in messages), messages[-20:]
    assert new_main != frozen


# --- 6. stop with chats in flight ------------------------------------------------------------


async def test_stopping_the_target_lets_running_chats_finish(box: Box, client: ChatClient) -> None:
    jobs = [
        await client.submit(f"drain {i}", max_tokens=LONG, seed=FULL_LENGTH_SEED) for i in range(4)
    ]
    firsts = [await first_delta(job) for job in jobs]
    # Freeze vLLM's engine processes so the chats are provably still running at the stop,
    # however fast this machine is; they resume during the drain.
    processes = box.cgroup_processes(WORKER)
    engine = [pid for pid, name in processes.items() if name.startswith("VLLM::")]
    assert len(engine) == 2, processes
    since = monotonic_us()
    box.run(f"kill -STOP {' '.join(map(str, engine))}")
    try:
        box.run(f"systemctl stop --no-block {TARGET}")
        box.wait_state(WORKER, "deactivating/stop-sigterm", timeout_s=10)
        await asyncio.sleep(1.0)
        # KillMode=mixed: SIGTERM went to the worker only; the engine processes are all there.
        assert set(engine) <= set(box.cgroup_processes(WORKER)), "engine killed early"
        draining = [e for e in events_of(box.journal(WORKER, since_monotonic_us=since))]
        assert any(e["event"] == "worker_draining" for e in draining), draining
    finally:
        box.run(f"kill -CONT {' '.join(map(str, engine))}")
    results = [await rest_of(stream, DRAIN_TIMEOUT_S + 30) for (_, stream) in firsts]
    for job, (seen, _), rest in zip(jobs, firsts, results, strict=True):
        assert_intact(seen + rest, job.job_id)
        assert isinstance(rest[-1], DoneEvent), rest[-1]
        assert rest[-1].usage.completion_tokens == LONG
    box.wait_state(WORKER, "inactive", timeout_s=DRAIN_TIMEOUT_S + 60)
    stopped_s = (monotonic_us() - since) / 1e6
    shown = box.show(WORKER, "Result", "ExecMainCode", "ExecMainStatus")
    assert shown == {"Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}, shown
    lines = systemd_lines(box.journal(WORKER, since_monotonic_us=since))
    assert not [line for line in lines if "timed out" in line], lines
    # Once the worker has exited (0), KillMode=mixed SIGKILLs what is left of the cgroup: only
    # multiprocessing's resource tracker may still be there, a moment from exiting by itself
    # (RemoveIPC= removes whatever shared memory it did not get to).
    killed = [int(pid) for pid in re.findall(r"Killing process (\d+)", "\n".join(lines))]
    assert all("resource_tracker" in processes.get(pid, "") for pid in killed), (killed, lines)
    assert box.cgroup_processes(WORKER) == {}
    FIGURES["box: stop edgeq.target with 4 chats in flight -> stopped, all done (s)"] = round(
        stopped_s, 1
    )


# --- 7. a bad setting ------------------------------------------------------------------------


def test_a_bad_setting_exits_78_and_is_not_restarted(box: Box) -> None:
    box.run(f"rm -r {DROPINS} && systemctl daemon-reload")  # the shipped unit from here on
    env_file = box.root / "etc/edgeq/edgeq.env"
    settings = env_file.read_text()
    env_file.write_text(settings + f"{BAD_SETTING}\n")
    try:
        since = monotonic_us()
        started = box.run(f"systemctl start {WORKER}", check=False)
        assert started.returncode != 0
        shown = box.show(WORKER, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
        assert shown["ExecMainStatus"] == "78", shown
        assert shown["ActiveState"] == "failed" and shown["Result"] == "exit-code", shown
        time.sleep(RESTART_SEC + 2)  # longer than RestartSec: no restart came
        later = box.show(WORKER, "ActiveState", "NRestarts")
        assert later == {"ActiveState": "failed", "NRestarts": shown["NRestarts"]}, later
        entries = box.journal(WORKER, since_monotonic_us=since)
        assert sum("Starting" in line for line in systemd_lines(entries)) == 1
        assert any("EDGEQ_MAX_NUM_SEQS" in e["MESSAGE"] for e in entries), entries
    finally:
        env_file.write_text(settings)
        box.run(f"systemctl reset-failed {WORKER}")


# --- 8. the start limit ----------------------------------------------------------------------


def test_a_unit_crashing_on_start_is_stopped_by_the_start_limit(box: Box) -> None:
    unit = "edgeq-worker@crashy.service"
    dropins = f"/etc/systemd/system/{unit}.d"
    # The shipped StartLimitBurst=4 / StartLimitIntervalSec=20min, with a release that dies at
    # once, restarted after 1 s instead of 15 s.
    box.run(
        f"mkdir -p {dropins} && printf '[Service]\\nExecStart=\\nExecStart=/opt/edgeq/current/"
        f'bin/python -c "raise SystemExit(3)"\\nRestartSec=1s\\n\' >{dropins}/crash.conf '
        "&& systemctl daemon-reload"
    )
    try:
        since = monotonic_us()
        box.run(f"systemctl start --no-block {unit}")
        deadline = time.monotonic() + 60
        lines: list[str] = []
        while not any("Start request repeated too quickly" in line for line in lines):
            assert time.monotonic() < deadline, (box.state(unit), lines)
            time.sleep(0.5)
            lines = systemd_lines(box.journal(unit, since_monotonic_us=since))
        time.sleep(3)  # longer than RestartSec: nothing more comes
        shown = box.show(unit, "ActiveState", "NRestarts", "StartLimitBurst")
        # Four starts; the fourth restart is refused.
        assert shown == {"ActiveState": "failed", "NRestarts": "4", "StartLimitBurst": "4"}
        lines = systemd_lines(box.journal(unit, since_monotonic_us=since))
        assert sum(line.startswith("Starting") for line in lines) == 4, lines
        # A manual start is refused too, until `systemctl reset-failed`.
        refused = box.run(f"systemctl start {unit}", check=False)
        assert refused.returncode != 0
        lines = systemd_lines(box.journal(unit, since_monotonic_us=since))
        assert sum(line.startswith("Starting") for line in lines) == 4, lines
    finally:
        box.run(f"rm -r {dropins}; systemctl reset-failed {unit}; systemctl daemon-reload")


# --- 10a, 11. upgrade, with the gateway --------------------------------------------------------


def test_upgrade_with_the_gateway_which_is_ready_only_after_the_worker(box: Box) -> None:
    """The worker is stopped (test 7): the upgrade starts it and the gateway; /ready says 503
    until the worker is READY."""
    command = f"cd {shlex.quote(box.bundles['v2'])} && ./install.sh --with-gateway 2>&1"
    started = time.monotonic()
    process = subprocess.Popen(
        [*box.nsenter(), "env", "-i", f"PATH={PATH}", "LANG=C.UTF-8", "sh", "-c", command],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[tuple[int, int]] = []
    try:
        while process.poll() is None:
            # Stamped once answered: a request begun before the worker was READY and answered
            # 200 after it (a clean-clone run) says nothing against the gateway.
            code = http_status(box, "http://127.0.0.1:8000/ready")
            seen.append((monotonic_us(), code))
            time.sleep(0.5)
        out = process.stdout.read() if process.stdout else ""
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    FIGURES["box: upgrade install.sh with the gateway (s)"] = round(time.monotonic() - started, 1)
    assert process.returncode == 0, out
    assert f"current -> {RELEASE}+b2 (previous: {RELEASE}" in out, out
    assert "smoke test passed" in out and "gateway ready" in out, out
    assert box.run("readlink /opt/edgeq/current").stdout.strip() == f"releases/{RELEASE}+b2"
    assert box.run("readlink /opt/edgeq/previous").stdout.strip() == f"releases/{RELEASE}"
    cmdline = box.run(f"tr '\\0' ' ' </proc/{main_pid(box)}/cmdline").stdout
    assert f"/opt/edgeq/releases/{RELEASE}+b2/bin/python" in cmdline, cmdline
    ready_us = int(
        box.show(WORKER, "ActiveEnterTimestampMonotonic")["ActiveEnterTimestampMonotonic"]
    )
    assert 503 in {code for _, code in seen}, seen  # the gateway up, the worker not yet
    assert all(at >= ready_us for at, code in seen if code == 200), (ready_us, seen)
    assert box.state(GATEWAY) == "active/running"


OPENAI_STREAM = r"""
import json, sys
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0)
chunks = list(client.chat.completions.create(
    model=sys.argv[1], messages=[{"role": "user", "content": "Hello through the gateway"}],
    max_tokens=24, stream=True))
print(json.dumps({
    "chunks": len(chunks),
    "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
    "finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
}))
"""


def test_the_openai_sdk_streams_through_the_gateway_unit(box: Box) -> None:
    model = "/var/lib/edgeq/models/tiny-qwen3"  # EDGEQ_MODEL in the bundle's edgeq.env
    result = subprocess.run(
        [*box.nsenter(net_only=True), sys.executable, "-c", OPENAI_STREAM, model],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_PROXY": "*"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    streamed = json.loads(result.stdout)
    assert streamed["chunks"] > 2 and streamed["text"], streamed
    assert streamed["finish"] in ("stop", "length"), streamed
    shown = box.show(GATEWAY, "User", "Result")
    assert shown == {"User": "edgeq", "Result": "success"}, shown


# --- 9. sandboxing ---------------------------------------------------------------------------

# Run by the unit's own sandbox (a probe instance of edgeq-worker@.service whose ExecStart is
# this script): each line is "name ok" or "name refused: <error>".
PROBE = r"""
try() {
    name=$1; shift
    if err=$("$@" 2>&1); then echo "$name ok"; else echo "$name refused: $err"; fi
}
try write-state touch /var/lib/edgeq/probe
try write-cache touch /var/cache/edgeq/probe
try write-tmp touch /tmp/probe
try write-usr touch /usr/lib/probe
try write-etc touch /etc/edgeq/probe
try write-release touch /opt/edgeq/current/probe
try write-var-lib touch /var/lib/probe
try read-root ls /root
try read-home ls /home
try read-redis-conf cat /etc/redis/redis-edgeq.conf
try see-redis test -e /proc/$REDIS_PID
try nvidiactl head -c1 /dev/nvidiactl
try nvidia0 head -c1 /dev/nvidia0
status=$(grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd):' /proc/self/status)
echo "status $(echo "$status" | tr -s '\t ' ' ' | tr '\n' ';')"
rm -f /var/lib/edgeq/probe /var/cache/edgeq/probe
"""


def test_the_worker_sandbox_holds(box: Box) -> None:
    # The running worker: no new privileges, a seccomp filter, no capabilities at all.
    status = (box.root / f"proc/{main_pid(box)}/status").read_text()
    fields = dict(re.findall(r"(?m)^(\w+):\s*(\S+)", status))
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", fields
    assert int(fields["CapEff"], 16) == int(fields["CapBnd"], 16) == 0, fields

    group = box.show(WORKER, "ControlGroup")["ControlGroup"]
    devices_controller = (box.root / f"sys/fs/cgroup/devices{group}/devices.list").exists()

    # What the unit's sandbox lets a process of it do: a probe instance of the same unit.
    unit = "edgeq-worker@probe.service"
    dropins = f"/etc/systemd/system/{unit}.d"
    redis_pid = box.show("redis-server.service", "MainPID")["MainPID"]
    (box.root / "etc/edgeq/box-probe.sh").write_text(PROBE)
    # Fake NVIDIA nodes (no driver behind them): DeviceAllow=/dev/nvidiactl lets it be opened
    # (ENXIO: no such device), DevicePolicy=closed refuses /dev/nvidia0 (EPERM), whose
    # char-nvidia-frontend major no driver registered here.
    box.run("mknod -m 666 /dev/nvidiactl c 195 255; mknod -m 666 /dev/nvidia0 c 195 0", check=False)
    box.run(
        f"mkdir -p {dropins} && printf '[Service]\\nType=exec\\nRestart=no\\nExecStart=\\n"
        f"ExecStart=/bin/sh /etc/edgeq/box-probe.sh\\nEnvironment=REDIS_PID={redis_pid}\\n' "
        f">{dropins}/probe.conf && systemctl daemon-reload"
    )
    try:
        since = monotonic_us()
        box.run(f"systemctl start {unit}")
        box.wait_state(unit, "inactive", "failed", timeout_s=60)
        lines = [
            e["MESSAGE"]
            for e in box.journal(unit, since_monotonic_us=since)
            if e.get("SYSLOG_IDENTIFIER") != "systemd"
        ]
    finally:
        box.run(
            f"rm -r {dropins} /etc/edgeq/box-probe.sh /dev/nvidiactl /dev/nvidia0; "
            f"systemctl reset-failed {unit}; systemctl daemon-reload",
            check=False,
        )
    results = dict(line.split(" ", 1) for line in lines if " " in line)
    print("\n".join(lines))
    for name in ("write-state", "write-cache", "write-tmp"):
        assert results[name] == "ok", (name, results)
    for name in ("write-usr", "write-etc", "write-release", "write-var-lib"):
        assert "Read-only file system" in results[name], (name, results)
    for name in ("read-root", "read-home", "read-redis-conf"):
        assert results[name].startswith("refused"), (name, results)
    assert results["see-redis"].startswith("refused"), results  # ProtectProc=invisible
    # PrivateDevices=no: the GPU's nodes are there (ENXIO: no driver behind the fake ones).
    assert "No such device" in results["nvidiactl"], results
    if devices_controller:
        assert "Operation not permitted" in results["nvidia0"], results  # DevicePolicy=closed
    else:
        # This container's systemd has no devices controller (a cgroup v1 host's nspawn does
        # not delegate it), so DevicePolicy= cannot bite here: left to a GPU box.
        assert "No such device" in results["nvidia0"], results
        FIGURES["box: DevicePolicy=closed"] = "not enforceable here (no devices cgroup)"
    assert "NoNewPrivs: 1;" in results["status"] and "Seccomp: 2;" in results["status"]

    # systemd-analyze security of the running unit says what the offline analysis says.
    live = box.run(f"systemd-analyze security --no-pager {WORKER}").stdout
    offline = box.run(
        "mkdir -p /tmp/box-units && cp /etc/systemd/system/edgeq-worker@.service /tmp/box-units/"
        " && cd /tmp/box-units && ln -sf edgeq-worker@.service edgeq-worker@cpu.service"
        " && systemd-analyze security --offline=true --no-pager ./edgeq-worker@cpu.service"
    ).stdout
    pattern = r"Overall exposure level for \S+: (\d+\.\d+)"
    (live_score,), (offline_score,) = re.findall(pattern, live), re.findall(pattern, offline)
    FIGURES["box: systemd-analyze security, live / offline"] = f"{live_score} / {offline_score}"
    assert live_score == offline_score, (live, offline)


# --- 10b. rollback, uninstall, purge ---------------------------------------------------------


def test_rollback_then_uninstall_keeps_settings_and_purge_removes_them(box: Box) -> None:
    upgraded = main_pid(box)
    out = install(box, box.bundles["v2"], "--rollback")
    assert f"rolled back from {RELEASE}+b2 to {RELEASE}" in out, out
    new_main = wait_ready_again(box, upgraded)
    cmdline = box.run(f"tr '\\0' ' ' </proc/{new_main}/cmdline").stdout
    assert f"/opt/edgeq/releases/{RELEASE}/bin/python" in cmdline, cmdline

    out = install(box, box.bundles["v2"], "--uninstall")
    assert "kept /etc/edgeq and /var/lib/edgeq" in out, out
    for unit in (WORKER, GATEWAY):
        assert box.state(unit).startswith("inactive"), unit
    files = box.run("systemctl list-unit-files --no-legend 'edgeq*'", check=False).stdout
    assert files.strip() == "", files
    assert box.run("test -e /opt/edgeq", check=False).returncode != 0
    assert box.run("test -f /etc/edgeq/edgeq.env && test -d /var/lib/edgeq/models").returncode == 0
    assert box.run("getent passwd edgeq", check=False).returncode == 0

    out = install(box, box.bundles["v2"], "--uninstall", "--purge")
    assert "removed edgeq, its settings" in out, out
    assert box.run("test -e /etc/edgeq || test -e /var/lib/edgeq", check=False).returncode != 0
    assert box.run("getent passwd edgeq", check=False).returncode != 0
    assert "redis-edgeq" not in (box.root / "etc/redis/redis.conf").read_text()
    assert box.state("redis-server.service") == "active/running"
    assert box.run("redis-cli -h 127.0.0.1 ping").stdout.strip() == "PONG"  # no password now
