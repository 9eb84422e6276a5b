"""systemd's sd_notify protocol in stdlib: READY=1, WATCHDOG=1, STOPPING=1, STATUS=.

One datagram per message to the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or an
abstract name written with a leading ``@``), as in systemd's own self-contained example
(man/notify-selfcontained-example.py, MIT-0). Outside systemd the variable is unset and every
call is a no-op. Nothing here ever raises into the worker: a lost notification costs at worst a
restart by the watchdog, an exception in the worker would cost the warm engine.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import structlog

log = structlog.get_logger("edgeq.notify")


def notify(message: str) -> bool:
    """Send one notification; True if it was sent, False when not under systemd or it failed."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)  # never stall the event loop on a full socket queue
            sock.connect(address)
            sock.sendall(message.encode())
    except (OSError, ValueError) as error:
        log.warning("notify_failed", message=message.split("\n", 1)[0], error=str(error))
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` (sd_watchdog_enabled(3)), or None when no watchdog is asked
    for this process (unset, invalid, or ``$WATCHDOG_PID`` names another process)."""
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


async def keep_watchdog(interval_s: float, healthy: Callable[[], bool] = lambda: True) -> None:
    """Ping the watchdog from the event loop while ``healthy()``: a loop stuck for
    WatchdogSec= gets restarted, and so does a worker whose engine stalled and did not end
    itself first (worker/liveness.py)."""
    while True:
        if healthy():
            notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
