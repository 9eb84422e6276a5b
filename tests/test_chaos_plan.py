"""The chaos campaign's parts that need no engine (edgeq.testing.chaos): the seeded plan, the
checks every job goes through, the report's arithmetic, and Redis restarted on its data."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from redis import Redis

from edgeq.cli import build_parser
from edgeq.core.protocol import DeltaEvent, DoneEvent, ErrorEvent, Timings, Usage
from edgeq.exit_codes import EXIT_JOB_FAILED
from edgeq.producer.client import build_request
from edgeq.testing.chaos import (
    FAULT_GAP_S,
    FAULT_KINDS,
    JOB_KINDS,
    POISON_KIND,
    QUIET_TAIL,
    Campaign,
    Cluster,
    Fault,
    FaultRecord,
    JobRecord,
    JobSpec,
    Report,
    WorkerSlot,
    check_events,
    check_outcome,
    fault_schedule,
    fault_start_s,
    job_spec,
    percentile,
    windows_of,
)
from edgeq.testing.engine_poison import POISON_ENV, POISON_SEED
from edgeq.testing.processes import WorkerProcess

JOB = "a" * 32


def delta(seq: int, text: str, job_id: str = JOB) -> DeltaEvent:
    return DeltaEvent(job_id=job_id, seq=seq, text=text)


def done(seq: int, finish_reason: str = "stop", continued: int | None = None) -> DoneEvent:
    return DoneEvent(
        job_id=JOB,
        seq=seq,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queued_ms=1, ttft_ms=2, total_ms=3),
        continued=continued,
    )


def error(seq: int, code: str) -> ErrorEvent:
    return ErrorEvent(job_id=JOB, seq=seq, code=code, message="why")


# --- the plan --------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = fault_schedule(3, 1800, FAULT_KINDS)
    assert first == fault_schedule(3, 1800, FAULT_KINDS)
    assert first != fault_schedule(4, 1800, FAULT_KINDS)


@pytest.mark.parametrize("seed", range(20))
def test_a_short_campaign_still_gets_every_kind_of_fault_one_after_another(seed: int) -> None:
    kinds = [k for k in FAULT_KINDS if k != "kill_gateway"]
    faults = fault_schedule(seed, 90, kinds, lease_ttl_s=5, outage_s=8)
    assert sorted(f.kind for f in faults[: len(kinds)]) == sorted(kinds)
    for before, after in itertools.pairwise(faults):
        assert after.at_s >= before.at_s + before.hold_s + 6  # one fault at a time, a gap after
    for fault in faults:
        if fault.kind == "stop_worker":
            assert fault.hold_s > 5  # past the lease: its jobs are handed over
        if fault.kind == "redis_outage":
            assert fault.hold_s > 8  # past the workers' outage limit
        if fault.kind == "restart_redis":
            assert fault.how in ("SIGTERM", "SIGKILL")
        if fault.kind == "slow_link":
            assert 0.05 <= fault.delay_s <= 0.4 and fault.hold_s >= 3
        else:
            assert fault.delay_s == 0.0


def test_a_fault_behind_a_late_one_keeps_its_gap() -> None:
    planned = Fault("kill_worker", at_s=40.0, hold_s=0.0)
    assert fault_start_s(planned, None) == 40.0
    assert fault_start_s(planned, 20.0) == 40.0  # the one before ended in time
    # The one before came late and ended at 38 s: not at 40 s, a whole gap after it.
    assert fault_start_s(planned, 38.0) == 38.0 + FAULT_GAP_S[0]


def test_a_long_campaign_keeps_faulting_until_its_quiet_tail() -> None:
    faults = fault_schedule(1, 1800, FAULT_KINDS)
    assert len(faults) > 80
    assert {f.kind for f in faults} == set(FAULT_KINDS)
    assert faults[-1].at_s + faults[-1].hold_s <= 1800 * (1 - QUIET_TAIL)


def test_the_workload_is_seeded_mixed_and_every_request_is_valid() -> None:
    specs = [job_spec(5, index, gateway=True) for index in range(400)]
    assert specs == [job_spec(5, index, gateway=True) for index in range(400)]
    assert specs != [job_spec(6, index, gateway=True) for index in range(400)]
    assert {spec.kind for spec in specs} == set(JOB_KINDS)
    assert {spec.fields["priority"] for spec in specs} == {"interactive", "default", "batch"}
    assert len({spec.fields["tenant"] for spec in specs}) == 3
    assert any(spec.via_gateway for spec in specs)
    assert not any(job_spec(5, index).via_gateway for index in range(400))
    for spec in specs:
        fields = {k: v for k, v in spec.fields.items() if k != "deadline_s"}
        build_request(spec.prompt, **fields)  # raises InvalidRequest for a bad one
        assert (spec.cancel_after_s is not None) == (spec.kind == "cancel")
        if spec.kind in ("long", "cancel"):
            assert spec.fields["max_tokens"] >= 150
        if spec.kind == "deadline":
            assert spec.fields["deadline_s"] <= 3


# --- the checks ------------------------------------------------------------------------------


def test_a_whole_stream_passes() -> None:
    assert check_events([delta(0, "a"), delta(1, "b"), done(2)], JOB) == []
    assert check_events([error(0, "expired")], JOB) == []


@pytest.mark.parametrize(
    ("events", "says"),
    [
        ([delta(0, "a"), delta(2, "b"), done(3)], "gap-free"),
        ([delta(0, "a"), delta(0, "a"), done(1)], "gap-free"),
        ([delta(0, "a"), done(1), error(2, "cancelled")], "2 terminal events"),
        ([delta(0, "a"), delta(1, "b")], "0 terminal events"),
        ([delta(0, "a", "b" * 32), done(1)], "another job"),
    ],
)
def test_a_broken_stream_is_named(events: list, says: str) -> None:
    assert any(says in problem for problem in check_events(events, JOB))


def record(kind: str, *events, gateway_cut: bool = False) -> JobRecord:
    spec = JobSpec(0, kind, "p", {})
    return JobRecord(spec, JOB, 0.0, events=list(events), gateway_cut=gateway_cut)


def test_an_ending_is_checked_against_its_kind() -> None:
    assert check_outcome(record("plain", delta(0, "ab"), done(1)), "ab") == []
    assert check_outcome(record("plain", delta(0, "ab"), done(1)), None) == []  # result gone
    assert "differs" in check_outcome(record("plain", delta(0, "ab"), done(1)), "abc")[0]
    assert check_outcome(record("plain", error(0, "worker_lost")), None) == []
    assert check_outcome(record("deadline", error(0, "expired")), None) == []
    assert check_outcome(record("cancel", delta(0, "x"), error(1, "cancelled")), None) == []
    assert check_outcome(record("plain", error(0, "engine_error")), None)
    assert check_outcome(record("plain", error(0, "cancelled")), None)  # nobody cancelled it
    # A gateway job whose gateway died has no listener: its worker abandons it.
    assert check_outcome(record("plain", error(0, "cancelled"), gateway_cut=True), None) == []


def test_a_chat_quarantined_with_a_poison_request_is_no_problem_only_after_one_was_sent() -> None:
    # A chat that shared both engines a poison request killed is quarantined with it (#41's
    # known gap): allowed once a poison request was sent, a problem before.
    bystander = record("plain", error(0, "poison_job"))
    assert check_outcome(bystander, None)
    assert check_outcome(bystander, None, after_poison=True) == []
    # The poison request itself must end poison_job, and nothing else.
    assert check_outcome(record(POISON_KIND, error(0, "poison_job")), None, after_poison=True) == []
    assert check_outcome(record(POISON_KIND, error(0, "worker_lost")), None, after_poison=True)


def test_bystanders_are_their_own_figure_not_failures(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, tmp_path, 0, False, 5.0, 8.0, True)
    try:
        campaign = Campaign(cluster, 1, 90, 8, ["poison"])
        campaign.report = Report(1, 90)
        poison = record(POISON_KIND, error(0, "poison_job"))
        bystander = JobRecord(JobSpec(1, "plain", "hi", {}), "b" * 32, 0.0,
                              events=[ErrorEvent(job_id="b" * 32, seq=0, code="poison_job",
                                                 message="m")])  # fmt: skip
        campaign.records = [poison, bystander]
        report = campaign._summarize()
    finally:
        shutil.rmtree(cluster.tmpdir, ignore_errors=True)
    assert report.failed == {"poison_job": 1}  # the poison request itself
    assert report.quarantined_bystanders == ["b" * 32]
    assert report.problems == []
    assert "(bystanders) 1" in report.render()


def test_a_json_answer_that_stopped_must_parse_one_cut_short_need_not() -> None:
    good = record("json", delta(0, '{"answer": "hi"}'), done(1))
    assert check_outcome(good, '{"answer": "hi"}') == []
    bad = record("json", delta(0, '{"answer": '), done(1))
    assert "does not parse" in check_outcome(bad, None)[0]
    cut = record("json", delta(0, '{"answer": '), done(1, finish_reason="length"))
    assert check_outcome(cut, None) == []


# --- the report ------------------------------------------------------------------------------


def test_percentiles_by_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0


def test_a_job_is_in_the_windows_of_the_faults_it_overlapped_recovery_included() -> None:
    faults = [FaultRecord("kill_worker", 10, 10, ""), FaultRecord("redis_outage", 30, 40, "")]
    assert windows_of(0, 9, faults) == []
    assert windows_of(12, 14, faults) == ["kill_worker@10.0"]  # within RECOVERY_S after it
    assert windows_of(16, 29, faults) == []
    assert windows_of(5, 35, faults) == ["kill_worker@10.0", "redis_outage@30.0"]


def test_the_report_renders_and_serializes() -> None:
    report = Report(seed=1, duration_s=90, accepted=3, done=2)
    report.faults = [FaultRecord("restart_redis", 5, 6, "SIGKILL")]
    report.ttft_ms = {"outside faults": {"n": 2, "p50": 10.0, "p99": 20.0}}
    report.problems = [{"job_id": JOB, "problem": "x", "fault_windows": []}]
    text = report.render()
    assert "restart_redis" in text and "problems: 1" in text
    assert json.loads(json.dumps(report.to_json()))["faults"][0]["kind"] == "restart_redis"


def test_the_command_takes_its_options() -> None:
    args = build_parser(["chaos"]).parse_args(
        ["chaos", "--duration", "90", "--seed", "3", "--faults", "kill_worker,redis_outage"]
    )
    assert (args.duration, args.seed, args.faults) == (90, 3, ("kill_worker", "redis_outage"))
    assert (args.workers, args.in_flight, args.gateway) == (2, 8, False)
    with pytest.raises(SystemExit):
        build_parser(["chaos"]).parse_args(["chaos", "--faults", "flood"])
    # Without --faults, every kind (run_chaos); the help names each one.
    assert build_parser(["chaos"]).parse_args(["chaos"]).faults is None
    chaos_help = build_parser(["chaos"])._subparsers._group_actions[0].choices["chaos"]
    assert all(kind in chaos_help.format_help() for kind in FAULT_KINDS)
    assert build_parser(["chaos"]).parse_args(["chaos", "--faults", "poison"]).faults == (
        "poison",
    )


# --- Redis restarted on its data -------------------------------------------------------------


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_redis_comes_back_on_its_port_with_what_it_had(tmp_path: Path, how: str) -> None:
    cluster = Cluster(tmp_path, tmp_path, 0, False, 5.0, 8.0, True)
    cluster.redis.start()
    try:
        redis = Redis.from_url(cluster.redis_url)
        # On disk before the kill: with the campaign's `appendfsync everysec` a SIGKILL may lose
        # the last second's writes (what worker/refill.py is for), and on a loaded machine it
        # lost this one. What is tested here is that Redis comes back, on its port, from disk.
        redis.config_set("appendfsync", "always")
        redis.set("kept", "yes")
        cluster.redis_down(how)
        with pytest.raises(Exception):  # noqa: B017 (whichever connection error redis-py raises)
            Redis.from_url(cluster.redis_url, socket_connect_timeout=0.5).ping()
        cluster.redis_up()
        assert Redis.from_url(cluster.redis_url).get("kept") == b"yes"
    finally:
        cluster.close()
    assert cluster.redis.process is None


def _settled_statuses(
    group: list[psutil.Process], wanted: Callable[[set[str]], bool], within_s: float = 10.0
) -> set[str]:
    """The group's process states once they are what is wanted, or as they are at the deadline."""
    deadline = time.monotonic() + within_s
    found = {p.status() for p in group}
    while not wanted(found) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = {p.status() for p in group}
    return found


def test_a_frozen_worker_and_its_children_are_stopped_and_resumed(tmp_path: Path) -> None:
    """SIGSTOP goes to the worker's process group: vLLM's processes are in it too."""
    parent = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    worker = WorkerProcess({}, tmp_path / "w.log", process=process)
    slot = WorkerSlot("w", worker=worker)
    cluster = Cluster(tmp_path, tmp_path, 0, False, 5.0, 8.0, True)
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(process.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        group = [psutil.Process(process.pid), *psutil.Process(process.pid).children()]
        assert len(group) == 2
        # Both started (asleep in time.sleep) before the freeze: a process still reading its
        # interpreter from disk is in uninterruptible sleep, and stops only once it wakes (the
        # child was still 'disk-sleep' 10 s after the SIGSTOP on CI run 20, while another test
        # wrote bundles of 900 MB).
        sleeping = {psutil.STATUS_SLEEPING}
        assert _settled_statuses(group, lambda found: found == sleeping, 120) == sleeping
        cluster.freeze_worker(slot, True)
        stopped = {psutil.STATUS_STOPPED}
        assert _settled_statuses(group, lambda found: found == stopped, 30) == stopped
        cluster.freeze_worker(slot, False)
        resumed = _settled_statuses(group, lambda found: psutil.STATUS_STOPPED not in found)
        assert psutil.STATUS_STOPPED not in resumed
    finally:
        worker.stop(signal.SIGKILL)  # the group: the child too
        cluster.close()


async def test_a_worker_ready_only_after_its_start_timeout_is_counted_as_serving(
    tmp_path: Path,
) -> None:
    """A 30-minute run (#34): an engine build took 334 s, past the harness's ready wait; the
    worker then served, but its slot was never counted as serving again."""
    cluster = Cluster(tmp_path, tmp_path, 1, False, 5.0, 8.0, True)
    slot = cluster.slots[0]
    log = tmp_path / "worker.log"
    log.write_text("")
    # A stand-in for a worker whose engine is still building: alive, not ready yet.
    starting = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220 (returns at once)
    slot.worker = WorkerProcess({}, log, process=starting)
    supervisor = asyncio.create_task(cluster.supervise(slot))
    try:
        await asyncio.sleep(0.5)
        assert not slot.ready  # still starting
        log.write_text(json.dumps({"event": "worker_ready", "level": "info"}) + "\n")
        deadline = time.monotonic() + 10  # the supervisor looks every 0.2 s, when it gets a core
        while not slot.ready and time.monotonic() < deadline:  # noqa: ASYNC110 (a plain flag)
            await asyncio.sleep(0.05)
        assert slot.ready
    finally:
        cluster.closing = True
        supervisor.cancel()
        slot.worker.process.kill()
        slot.worker.process.wait()
        shutil.rmtree(cluster.tmpdir, ignore_errors=True)


async def test_a_worker_whose_engine_a_poison_request_killed_is_no_surprise(
    tmp_path: Path,
) -> None:
    """While a poison request is out, a serving worker exiting 1 (its engine died of it) is
    counted as the poison's, not as a worker that died on its own; the workers of a campaign
    with a poison fault have the poison armed."""
    cluster = Cluster(tmp_path, tmp_path, 1, False, 5.0, 8.0, True, poison=True)
    slot = cluster.slots[0]
    assert cluster.worker_env(slot)[POISON_ENV] == str(POISON_SEED)
    dying = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
        [sys.executable, "-c", f"raise SystemExit({EXIT_JOB_FAILED})"]
    )
    slot.worker = WorkerProcess({}, tmp_path / "worker.log", process=dying)
    slot.ready, slot.incarnation, cluster.poisoning = True, 1, True
    supervisor = asyncio.create_task(cluster.supervise(slot))
    try:
        deadline = time.monotonic() + 10  # well before its restart (RESTART_DELAY_S)
        while not cluster.poison_deaths and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert cluster.poison_deaths == ["worker-0#1"]
        assert cluster.surprises == []
    finally:
        cluster.closing = True  # no restart
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        dying.wait()
        shutil.rmtree(cluster.tmpdir, ignore_errors=True)
