"""Waiting in the router's tests for what the code under test reaches on its own (a background
task, a server on another socket): `until` is the shared one (`tests.waiting`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.router.fake_worker import FakeWorker
from tests.waiting import BOUND_S, until

__all__ = ["cancel_once_started", "until"]


async def cancel_once_started(task: asyncio.Task[Any], worker: FakeWorker) -> None:
    """Cancel `task`, a request that ends on `worker`, once the worker has it; return when the
    worker saw its request cancelled (the connection closed under it)."""
    await until(worker.completions, what=f"{worker.name} got the request")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(BOUND_S):
        await worker.cancelled.wait()
