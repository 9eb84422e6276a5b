"""The CPU account of a bench run: which processes are the engine's, and what they used."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from edgeq.bench.cpu import cpu_s_by_role, cpu_us_per_token, process_cpu_s
from edgeq.worker.engine_processes import (
    engine_pids,
    identify,
    kill_and_wait,
    wait_until_gone,
)

# A child that names itself as vLLM names its engine processes, then burns CPU until killed.
ENGINE_LIKE = """
import ctypes, sys
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm
print("named", flush=True)
while True:
    pass
"""

BUSY_CPU_TIMEOUT_S = 30


@pytest.fixture
def busy_children() -> Iterator[list[subprocess.Popen[bytes]]]:
    children = [
        subprocess.Popen([sys.executable, "-c", ENGINE_LIKE, name], stdout=subprocess.PIPE)
        for name in ("VLLM::EngineCore", "not-the-engine")
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == b"named\n"
        yield children
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_the_engines_processes_are_found_by_name_among_the_descendants(
    busy_children: list[subprocess.Popen[bytes]],
) -> None:
    engine, other = busy_children
    found = engine_pids(os.getpid())  # the suite's own workers' engines are descendants too
    assert engine.pid in found and other.pid not in found
    assert engine_pids(other.pid) == []  # no descendants at all


def test_cpu_by_role_counts_what_each_role_used_and_a_gone_process_as_zero(
    busy_children: list[subprocess.Popen[bytes]],
) -> None:
    engine, other = busy_children
    roles = {"engine": [engine.pid], "gone": [2**22 + 1]}
    before = cpu_s_by_role(roles)
    # Until the busy loop has used 0.1 s: a CI run beside two engines gave it no CPU at all
    # for half a second.
    deadline = time.monotonic() + BUSY_CPU_TIMEOUT_S
    while (after := cpu_s_by_role(roles))["engine"] - before["engine"] <= 0.1:
        assert time.monotonic() < deadline, f"no CPU counted for a busy loop: {before}, {after}"
        time.sleep(0.1)
    assert before["gone"] == after["gone"] == 0.0
    assert process_cpu_s(other.pid) > 0


# A child that starts an engine-like child of its own, as a worker started by a test does.
WORKER_LIKE = """
import subprocess, sys, time
command = [sys.executable, "-c", sys.argv[1], "VLLM::EngineCore"]
engine = subprocess.Popen(command, stdout=subprocess.PIPE)
assert engine.stdout.readline() == b"named\\n"
print(engine.pid, flush=True)
time.sleep(60)
"""


def test_a_process_s_own_engine_leaves_out_the_engines_of_processes_it_started(
    busy_children: list[subprocess.Popen[bytes]],
) -> None:
    engine, _ = busy_children
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_LIKE, ENGINE_LIKE], stdout=subprocess.PIPE
    )
    assert worker.stdout is not None
    workers_engine = int(worker.stdout.readline())
    try:
        assert {engine.pid, workers_engine} <= set(engine_pids(os.getpid()))
        own = engine_pids(os.getpid(), own=True)
        assert engine.pid in own and workers_engine not in own
    finally:
        os.kill(workers_engine, 9)
        worker.kill()
        worker.wait()


def test_an_engine_process_is_waited_for_until_killed(
    busy_children: list[subprocess.Popen[bytes]],
) -> None:
    engine, _ = busy_children
    (process,) = identify([engine.pid])
    assert wait_until_gone([process], timeout_s=0.2) == [process]  # busy, not ending
    assert kill_and_wait([process], timeout_s=5) == []  # a zombie counts as gone: no memory


def test_cpu_per_token_names_the_front_process_of_each_kind_of_run() -> None:
    # A queue run: the worker's own process is the front, the bench process the client.
    queue = cpu_us_per_token(
        {"worker": 0.5, "engine": 2.0, "redis": 0.1}, 0.2, 10_000, in_process=False
    )
    assert queue == pytest.approx({"front": 50.0, "engine": 200.0, "redis": 10.0, "client": 20.0})
    # A direct run: the engine's front end is in the bench process, which has no client part.
    direct = cpu_us_per_token({"engine": 2.0}, 0.3, 10_000, in_process=True)
    assert direct == pytest.approx({"engine": 200.0, "front": 30.0})
    assert cpu_us_per_token({"engine": 2.0}, 0.3, 0, in_process=True) == {}
