"""Ending tasks whose cancel can be lost (edgeq.core.tasks): the gateway ends a stream reader
this way when its HTTP client leaves, a client its pub/sub reader, a worker its listeners."""

from __future__ import annotations

import asyncio

from edgeq.core.tasks import cancel_and_wait


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    """As Python 3.11's asyncio.wait_for does when its result comes in the same loop turn as
    the cancel: the first CancelledError never reaches the task's code."""
    cancels_seen = 0

    async def loses_one_cancel() -> None:
        nonlocal cancels_seen
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels_seen += 1
                if cancels_seen == 1:
                    continue  # swallowed: goes on waiting, as a stream reader did
                raise

    task = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait(task, recancel_after_s=0.05)
    assert task.cancelled() and cancels_seen == 2


async def test_a_task_that_cleans_up_after_its_cancel_is_not_interrupted() -> None:
    cleaned_up = asyncio.Event()

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # an UNSUBSCRIBE, a lease release
            cleaned_up.set()

    task = asyncio.create_task(cleans_up())
    await asyncio.sleep(0)
    await cancel_and_wait(task, recancel_after_s=1.0)
    assert task.cancelled() and cleaned_up.is_set()


async def test_tasks_that_already_ended_are_returned_at_once() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed, finished = asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    async with asyncio.timeout(0.5):  # nothing to cancel, nothing raised: their outcomes
        await cancel_and_wait(failed, finished)  # are read, so none is logged at GC either
    assert isinstance(failed.exception(), RuntimeError) and finished.done()
