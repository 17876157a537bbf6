"""`cancel_and_wait`: a bounded stop for background tasks."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from ownerserve.tasks import cancel_and_wait


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
