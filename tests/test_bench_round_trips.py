"""``python -m edgeq.bench.chat_round_trips``, the worker's Redis commands per chat that
docs/performance.md states (#42), still runs and attributes them: a few chats on a simulated
box (the real worker around a stand-in engine, no vLLM engine)."""

from __future__ import annotations

import asyncio

from edgeq.bench.chat_round_trips import measure


def test_a_chats_end_costs_the_worker_no_settlement_of_its_own() -> None:
    _, counts = asyncio.run(measure(chats=3, max_tokens=4))
    # The worker's own traffic is seen: its claims and its events' publishes.
    assert counts["EVALSHA publish"] >= 3 and counts["EVALSHA claim"] >= 1
    # The settlement is part of the terminal publish: no script of its own.
    assert counts["EVALSHA settle (before #42)"] == 0
