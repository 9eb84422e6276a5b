"""The job's start line and metrics wait until the event loop is free (edgeq.worker.chat_run):
the other jobs of a claimed burst reach the engine first, and a job that ends before the loop
was free still logs its start before its end."""

from __future__ import annotations

import asyncio

import pytest

from edgeq.worker.chat_run import sooner_or_on_exit


async def test_the_deferred_call_runs_after_the_tasks_already_waiting_to_run() -> None:
    order: list[str] = []

    async def job(name: str) -> None:
        with sooner_or_on_exit(lambda: order.append(f"{name} announced")):
            order.append(f"{name} handed to the engine")
            await asyncio.sleep(0.01)  # the first suspension: the engine works

    await asyncio.gather(*(job(name) for name in ("a", "b", "c")))
    assert order == [
        "a handed to the engine",
        "b handed to the engine",
        "c handed to the engine",
        "a announced",
        "b announced",
        "c announced",
    ]


async def test_a_block_left_before_the_loop_was_free_runs_the_call_first_and_once() -> None:
    order: list[str] = []
    with pytest.raises(ValueError):
        with sooner_or_on_exit(lambda: order.append("announced")):
            raise ValueError("refused before the first suspension")
    order.append("failure logged")
    await asyncio.sleep(0)  # the loop is free: the call must not run again
    assert order == ["announced", "failure logged"]
