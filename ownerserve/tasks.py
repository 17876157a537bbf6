"""Stopping and awaiting tasks without hanging the code that waits, nor eating its cancel.

The usual `task.cancel()` then `await task` waits for as long as the task takes to end, which is
forever for a task that swallows its cancellation (Python 3.11's `asyncio.wait_for` does so when
the cancel lands as its inner wait finishes; a library may too). Closing a router, a directory
or a subscriber must not hang on that: `cancel_and_wait` waits a bounded time, logs a task that
is still running then (it is left to the event loop), and logs an error a task ended with
instead of raising it into the closer.

Code that waits for tasks it started (a request's concurrent hops, what a closer lets finish)
must not guard `await task` with `suppress(BaseException)`: the `CancelledError` it eats may be
the waiter's own (its client left, or the `asyncio.timeout` around it ran out, which then never
raises its `TimeoutError`). `wait_ended` waits for the tasks' ends through `asyncio.wait`, which
never raises what a task ended with, so a `CancelledError` out of it is the waiter's own and
goes on; `finish_or_cancel` lets tasks finish, then stops the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
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


async def wait_ended(
    tasks: Collection[asyncio.Future[Any]],
    timeout_s: float | None = None,
    *,
    errors_at: int = logging.WARNING,
    cancel_timeout_s: float = 5.0,
) -> bool:
    """Wait until every one of `tasks` has ended, at most `timeout_s` (None: no bound); True
    when they all have. What a task ended with is never raised: a cancel is ignored (the caller
    usually asked for it), an error is logged at `errors_at` (once it comes, for a task still
    running at the bound).

    A cancel of the caller propagates, as it would out of `await task`, and like that it first
    cancels the tasks still running; unlike it, the caller then waits for their ends (at most
    `cancel_timeout_s`, for a task that swallows its cancel) before its `CancelledError` goes
    on, so no task is left running behind a caller that was given up.

    Why not `await task` and `current_task().cancelling()` to tell whose cancel it was: a task
    the caller cancelled raises its own `CancelledError` out of `await task`, and `cancelling()`
    is already non-zero in a caller cleaning up after a cancel it took (a `finally`), and zero
    again after an `uncancel()`; `asyncio.wait` raises only the caller's own."""
    try:
        return await _wait_ended(tasks, timeout_s, cancel_timeout_s)
    finally:
        _reap(tasks, errors_at)


async def finish_or_cancel(
    tasks: Collection[asyncio.Future[Any]], grace_s: float, timeout_s: float = 5.0
) -> bool:
    """Let `tasks` finish on their own for `grace_s`, then cancel those still running and wait
    at most `timeout_s` more; True when all have ended, else those still running are logged and
    left to the event loop. Errors and the caller's cancel as in `wait_ended`."""
    try:
        if await _wait_ended(tasks, grace_s, timeout_s):
            return True
        for t in tasks:
            t.cancel()
        if await _wait_ended(tasks, timeout_s, timeout_s):
            return True
    finally:
        _reap(tasks, logging.WARNING)
    running = [t for t in tasks if not t.done()]
    log.warning(
        "%d task(s) did not stop within %.1f s of their cancel; left running: %s",
        len(running), timeout_s, running,
    )  # fmt: skip
    return False


async def _wait_ended(
    tasks: Collection[asyncio.Future[Any]], timeout_s: float | None, cancel_timeout_s: float
) -> bool:
    running = [t for t in tasks if not t.done()]
    if not running:
        return True
    try:
        await asyncio.wait(running, timeout=timeout_s)
    except asyncio.CancelledError:
        still = [t for t in running if not t.done()]
        for t in still:
            t.cancel()
        if still:
            # a second cancel of the caller propagates from here at once
            await asyncio.wait(still, timeout=cancel_timeout_s)
        raise
    return all(t.done() for t in running)


def _reap(tasks: Collection[asyncio.Future[Any]], level: int) -> None:
    """Retrieve what each of `tasks` ended with, now or once it ends (no "exception was never
    retrieved" later): an error is logged at `level`, a cancel ignored."""
    for t in tasks:
        if t.done():
            _log_error(t, level)
        else:
            t.add_done_callback(lambda t: _log_error(t, level))


def _log_error(task: asyncio.Future[Any], level: int) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        log.log(level, "task %s ended with an error", name, exc_info=exc)


__all__ = ["cancel_and_wait", "finish_or_cancel", "wait_ended"]
