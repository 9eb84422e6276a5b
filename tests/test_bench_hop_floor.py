"""``python -m edgeq.bench.hop_floor``, the raw-socket floor docs/performance.md states, still runs
and measures what it says: a few chats, Redis only, no engine."""

from __future__ import annotations

import re
import subprocess
import sys

from edgeq.bench.hop_floor import measure
from edgeq.testing.processes import RedisServer


def test_each_chat_beyond_the_worker_sleep_is_counted(redis_server: RedisServer) -> None:
    rounds = measure(redis_server.port, chats=5, rounds=2, pause_s=0.01, first_token_s=0.005)
    assert [len(chats) for chats in rounds] == [5, 5]
    for chats in rounds:
        assert chats == sorted(chats)
        # Loopback hops take well under a second and never less than nothing.
        assert all(0 < ms < 1000 for ms in chats)


def test_the_documented_command_prints_one_line_per_round() -> None:
    printed = subprocess.run(
        [
            *(sys.executable, "-m", "edgeq.bench.hop_floor"),
            *("--chats", "4", "--rounds", "2", "--pause-ms", "10", "--first-token-ms", "5"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = printed.strip().splitlines()
    assert len(lines) == 2
    for number, line in enumerate(lines, 1):
        assert re.fullmatch(
            rf"round {number}: enqueue -> first token, beyond the worker's 5 ms: "
            r"median \d+\.\d{3} ms \[\d+\.\d{3}-\d+\.\d{3}\] over 4 chats",
            line,
        ), line
