"""`cancel_and_wait`: a bounded stop for background tasks; `wait_ended` and `finish_or_cancel`:
waiting for tasks without raising what they ended with, nor eating the waiter's own cancel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from ownerserve.tasks import cancel_and_wait, finish_or_cancel, wait_ended


async def test_a_task_that_honours_its_cancel_is_waited_for() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, timeout_s=5.0)
    assert task.cancelled()
    assert await cancel_and_wait(None)


async def test_a_task_that_swallows_its_cancel_does_not_hang_the_closer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # the cancel is swallowed: without a bound, a closer waits forever

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ownerserve.tasks"):
        assert not await cancel_and_wait(task, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert "did not stop" in caplog.text and not task.done()
    release.set()
    await task


async def test_an_error_the_task_ended_with_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(broken(), name="broken")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="ownerserve.tasks"):
        assert await cancel_and_wait(task)
    assert "stopped with an error" in caplog.text and "boom" in caplog.text


async def test_a_cancel_of_the_closer_still_propagates() -> None:
    inner = asyncio.create_task(asyncio.sleep(3600))

    async def stubborn() -> None:
        try:
            await inner
        except asyncio.CancelledError:
            await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    closer = asyncio.create_task(cancel_and_wait(task, timeout_s=60.0))
    await asyncio.sleep(0.05)
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    task.cancel()
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def slow_to_stop(stopping: asyncio.Event, steps: int = 5) -> None:
    """Sleeps until cancelled, then takes `steps` turns of the loop to clean up (as a hop
    closing its connection does), then re-raises."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        stopping.set()
        for _ in range(steps):
            await asyncio.sleep(0)
        raise


async def test_a_task_the_caller_cancelled_ends_quietly() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    task.cancel()
    # `await task` would raise the task's CancelledError here: not the caller's own
    assert await wait_ended([task])
    assert task.cancelled()
    assert await wait_ended([])


async def test_a_cancel_of_the_waiter_propagates_once_its_tasks_ended() -> None:
    stopping = asyncio.Event()
    task = asyncio.create_task(slow_to_stop(stopping))
    waiter = asyncio.create_task(wait_ended([task]))
    await asyncio.sleep(0)  # the task is asleep, the waiter waits on it
    assert not task.done() and not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # like `await task`, the cancel went on to the task; unlike it, the waiter saw it end
    assert stopping.is_set() and task.done() and task.cancelled()


async def test_a_cancel_of_the_waiter_propagates_past_a_task_that_swallows_its_own() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await release.wait()
                return
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    waiter = asyncio.create_task(wait_ended([task], cancel_timeout_s=0.1))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.done()  # left to the event loop after the bound
    release.set()
    await task


async def test_a_timeout_around_the_wait_raises_its_timeout_error() -> None:
    # the task was cancelled and takes long to end: the timeout around its waiter runs out
    # meanwhile; `suppress(BaseException): await task` would eat the cancel the timeout
    # works by, and the code would go on past its deadline as if none were set
    release = asyncio.Event()

    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # a cleanup that ends on a second cancel only
            raise

    task = asyncio.create_task(slow_cleanup())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await wait_ended([task])
    assert task.done()  # the timeout's cancel went on to it, and it ended
    assert not release.is_set()


async def test_an_error_a_task_ended_with_is_logged_at_the_level_asked_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(broken(), name="broken")
    ok = asyncio.create_task(asyncio.sleep(0))
    with caplog.at_level(logging.DEBUG, logger="ownerserve.tasks"):
        assert await wait_ended([task, ok], errors_at=logging.INFO)
    [record] = [r for r in caplog.records if r.name == "ownerserve.tasks"]
    assert record.levelno == logging.INFO and "broken" in record.getMessage()
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])


async def test_a_task_running_at_the_bound_is_reported_and_its_later_error_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fail = asyncio.Event()

    async def fails_later() -> None:
        await fail.wait()
        raise RuntimeError("late")

    task = asyncio.create_task(fails_later(), name="late")
    with caplog.at_level(logging.WARNING, logger="ownerserve.tasks"):
        assert not await wait_ended([task], timeout_s=0.01)
        assert not [r for r in caplog.records if r.name == "ownerserve.tasks"]
        fail.set()
        with pytest.raises(RuntimeError):
            await task
        await asyncio.sleep(0)  # its done callbacks run
    assert "late" in caplog.text


async def test_finish_or_cancel_lets_tasks_finish_then_stops_the_rest() -> None:
    finish = asyncio.Event()
    finish.set()
    done_soon = asyncio.create_task(finish.wait())
    stopping = asyncio.Event()
    forever = asyncio.create_task(slow_to_stop(stopping))
    assert await finish_or_cancel([done_soon, forever], grace_s=0.05)
    assert done_soon.done() and not done_soon.cancelled() and done_soon.result()
    assert stopping.is_set() and forever.cancelled()
    assert await finish_or_cancel([], grace_s=1.0)


async def test_finish_or_cancel_reports_a_task_that_will_not_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = asyncio.create_task(stubborn(), name="stubborn")
    with caplog.at_level(logging.WARNING, logger="ownerserve.tasks"):
        assert not await finish_or_cancel([task], grace_s=0.01, timeout_s=0.01)
    assert "did not stop" in caplog.text and not task.done()
    release.set()
    await task
