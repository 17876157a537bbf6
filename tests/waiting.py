"""Waiting, in any test, for what the code under test reaches on its own (a background task, a
server in another process, a message on another socket): on the condition itself, with a
bound, never for a fixed time. A busy machine stretches how long things take, not what they
do, so the bounds are generous: they end a test that would otherwise hang, and say what it
waited for."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

BOUND_S = 30.0
"""The default bound: far past anything these tests wait for, far below pytest's timeout."""


async def until(
    cond: Callable[[], object | Awaitable[object]],
    timeout_s: float = BOUND_S,
    poll_s: float = 0.01,
    what: str = "",
) -> None:
    """Return once `cond()` (a plain or an async callable) is true, polling every `poll_s`;
    an `AssertionError` naming `what` (or `cond`) once `timeout_s` has passed without it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"not reached within {timeout_s:g} s: {what or cond!r}")
        await asyncio.sleep(poll_s)


def until_sync(
    cond: Callable[[], object], timeout_s: float = BOUND_S, poll_s: float = 0.02, what: str = ""
) -> None:
    """`until` for a test without an event loop (processes, threads)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout_s:g} s: {what or cond!r}")
        time.sleep(poll_s)


async def settled(router: Any, timeout_s: float = BOUND_S) -> None:
    """Wait for every task the router runs in the background (`Router.spawn`: a directory
    commit concurrent with the answer, a replica copy, a health re-check) to end, including
    the ones those start. A client holding the answer knows only that they were started: with
    a shared (Redis) directory the commit runs beside the response, so whatever reads the
    directory next — a test, the next turn on another replica — waits for this first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while router.background:
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"router background tasks still running: {router.background}")
        # not gather: a bound running out must not cancel the router's own tasks
        await asyncio.wait(list(router.background), timeout=left)
