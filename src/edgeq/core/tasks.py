"""Ending tasks whose cancel can be lost.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result instead of raising when that
result arrives in the same loop turn as a cancel (3.12 rebuilt it on ``asyncio.timeout``), and
redis-py 5 (arq's pin) sends every command through it with a socket timeout (edgeq's own
connections no longer do, core/connection.py; a pool made elsewhere still does). So a task
cancelled while its Redis write completes does not see the cancel: a stream reader waits on
until its stream timeout, a listener loop runs forever, and whoever awaits it hangs.
``cancel_and_wait`` cancels again whatever is still running after a moment, as anyio's cancel
scopes do; the moment leaves a task that did see the cancel time to finish its cleanup (an
UNSUBSCRIBE, a release).
"""

from __future__ import annotations

import asyncio
from typing import Any

# How long a cancelled task may take to end before it is cancelled again.
RECANCEL_AFTER_S = 0.5


async def cancel_and_wait(
    *tasks: asyncio.Future[Any], recancel_after_s: float = RECANCEL_AFTER_S
) -> None:
    """Cancel the tasks and return once every one has ended (its outcome retrieved, so an
    error it ended with is not reported as never retrieved)."""
    running = {task for task in tasks if not task.done()}
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=recancel_after_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()
