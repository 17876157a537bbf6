"""Stopping background tasks without hanging the code that stops them.

The usual `task.cancel()` then `await task` waits for as long as the task takes to end, which is
forever for a task that swallows its cancellation (Python 3.11's `asyncio.wait_for` does so when
the cancel lands as its inner wait finishes; a library may too). Closing a router, a directory
or a subscriber must not hang on that: `cancel_and_wait` waits a bounded time, logs a task that
is still running then (it is left to the event loop), and logs an error a task ended with
instead of raising it into the closer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any] | None, timeout_s: float = 5.0) -> bool:
    """Cancel `task` and wait at most `timeout_s` for it to end; True when it has ended. A
    cancel of the caller still propagates (the task is not waited for then)."""
    if task is None:
        return True
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=timeout_s)
    if not done:
        log.warning(
            "task %s did not stop within %.1f s of its cancel; left running", task, timeout_s
        )
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("task %s had stopped with an error", task.get_name(), exc_info=task.exception())
    return True


__all__ = ["cancel_and_wait"]
