"""worker/notify.py: the sd_notify protocol against real AF_UNIX datagram sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeq.worker.notify import keep_watchdog, notify, watchdog_interval_s


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(2)
    yield sock
    sock.close()


def test_a_path_socket_gets_the_message(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.getsockname())
    assert notify("READY=1\nSTATUS=warm")
    assert receiver.recv(4096) == b"READY=1\nSTATUS=warm"


def test_an_abstract_socket_written_with_at(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"edgeq-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1")
        assert sock.recv(4096) == b"STOPPING=1"


def test_unset_is_a_no_op_and_a_dead_socket_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", f"@edgeq-nobody-{uuid.uuid4().hex}")
    assert notify("READY=1") is False


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    assert watchdog_interval_s() == 1.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 1.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    assert watchdog_interval_s() is None


async def test_keep_watchdog_pings_until_cancelled(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.getsockname())
    task = asyncio.create_task(keep_watchdog(0.05))
    await asyncio.sleep(0.3)
    task.cancel()
    receiver.setblocking(False)
    pings = []
    while True:
        try:
            pings.append(receiver.recv(64))
        except BlockingIOError:
            break
    assert len(pings) >= 3 and set(pings) == {b"WATCHDOG=1"}


async def test_keep_watchdog_sends_nothing_while_the_worker_is_not_healthy(
    receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stalled engine (worker/liveness.py): systemd's watchdog is left to run out.
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.getsockname())
    healthy = asyncio.Event()
    task = asyncio.create_task(keep_watchdog(0.01, healthy=lambda: healthy.is_set()))
    await asyncio.sleep(0.1)
    receiver.setblocking(False)
    with pytest.raises(BlockingIOError):
        receiver.recv(64)
    healthy.set()
    ping = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(receiver, 64), 5)
    assert ping == b"WATCHDOG=1"  # pings again once it is
    task.cancel()
