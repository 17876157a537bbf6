"""Waiting in the router's tests for what the code under test reaches on its own (a background
task, a server on another socket)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.router.fake_worker import FakeWorker


async def until(cond: Callable[[], object], timeout_s: float = 5.0, poll_s: float = 0.01) -> None:
    """Return once `cond()` is true, polling every `poll_s`; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(poll_s)


async def cancel_once_started(task: asyncio.Task[Any], worker: FakeWorker) -> None:
    """Cancel `task`, a request that ends on `worker`, once the worker has it; return when the
    worker saw its request cancelled (the connection closed under it)."""
    await until(worker.completions, timeout_s=2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(5.0):
        await worker.cancelled.wait()
