"""A Mooncake Store master (`mooncake_master`, shipped in the `mooncake-transfer-engine` wheels)
started on free loopback ports with its HTTP metadata server, for the demo, tests and
benchmarks; a real cluster names an existing master instead (`MasterAddress.parse`).

Readiness is a condition, not a pause: the RPC port and the metadata server both answer.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, urlsplit

from ownerserve.ports import free_port

MASTER_BINARY = "mooncake_master"
DEFAULT_METADATA_PORT = 8080
"""`mooncake_master`'s default `--http_metadata_server_port`."""
URL_SCHEME = "mooncake"


class MasterUnavailable(RuntimeError):
    """No `mooncake_master` can run here, or the one started did not become ready."""


@dataclass(frozen=True, slots=True)
class MasterAddress:
    """Where a Mooncake Store master listens: its RPC port (clients' `master_server_addr`) and
    the HTTP metadata server the transfer engines exchange segment descriptors through."""

    host: str
    rpc_port: int
    metadata_port: int = DEFAULT_METADATA_PORT

    @property
    def rpc(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def url(self) -> str:
        """`mooncake://HOST:RPC_PORT?metadata_port=PORT`: what `parse` reads back."""
        return f"{URL_SCHEME}://{self.rpc}?metadata_port={self.metadata_port}"

    @classmethod
    def parse(cls, text: str) -> MasterAddress:
        """`mooncake://HOST:PORT[?metadata_port=PORT]` -> the address; `ValueError` naming what
        is wrong otherwise. Without `metadata_port` the master's default (8080) is assumed."""
        parts = urlsplit(text)
        if parts.scheme != URL_SCHEME or not parts.hostname:
            raise ValueError(f"expected mooncake://HOST:PORT[?metadata_port=PORT], got {text!r}")
        try:
            rpc_port = parts.port
        except ValueError:
            raise ValueError(f"{text!r}: the port is not a number from 0 to 65535") from None
        if rpc_port is None:
            raise ValueError(f"{text!r}: the master's RPC port is required")
        query = parse_qs(parts.query)
        unknown = set(query) - {"metadata_port"}
        if unknown or parts.path not in ("", "/"):
            raise ValueError(f"{text!r}: only ?metadata_port=PORT may follow HOST:PORT")
        metadata = query.get("metadata_port", [str(DEFAULT_METADATA_PORT)])[-1]
        if not metadata.isdigit() or not 0 < int(metadata) < 65536:
            raise ValueError(f"{text!r}: metadata_port must be a port number")
        return cls(parts.hostname, rpc_port, int(metadata))


def find_master_binary() -> Path:
    """The `mooncake_master` executable: beside this Python (a venv's bin), inside the
    installed `mooncake` package, or on PATH; `MasterUnavailable` saying where it looked."""
    candidates = [Path(sys.executable).parent / MASTER_BINARY]
    with contextlib.suppress(ImportError):
        import mooncake

        candidates.append(Path(mooncake.__file__).parent / MASTER_BINARY)
    on_path = shutil.which(MASTER_BINARY)
    if on_path:
        candidates.append(Path(on_path))
    not_executable = []
    for path in candidates:
        if path.is_file():
            if os.access(path, os.X_OK):
                return path
            not_executable.append(str(path))
    if not_executable:
        raise MasterUnavailable(
            f"{MASTER_BINARY} is not executable: {', '.join(not_executable)} (chmod +x it)"
        )
    raise MasterUnavailable(
        f"{MASTER_BINARY} not found (looked in {', '.join(str(p) for p in candidates)} and "
        "PATH; it ships in the mooncake-transfer-engine wheels)"
    )


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _metadata_answers(host: str, port: int) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        conn.request("GET", "/metadata?key=ownerserve-probe")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def master_answers(address: MasterAddress) -> bool:
    """Whether a master's RPC port accepts connections and its metadata server answers."""
    return _accepts(address.host, address.rpc_port) and _metadata_answers(
        address.host, address.metadata_port
    )


class MooncakeMaster:
    """One `mooncake_master` child process on loopback ports of its own (`start`), stopped by
    `stop` (SIGTERM, then SIGKILL) or as a context manager; `kill` and `start` again on the
    same ports are what the fault tests do."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        metadata_port: int | None = None,
        client_ttl_s: int = 10,
        lease_ttl_ms: int = 10_000,
        log_path: Path | None = None,
        binary: Path | None = None,
    ) -> None:
        self.binary = binary or find_master_binary()
        self.address = MasterAddress(host, rpc_port or free_port(), metadata_port or free_port())
        self.metrics_port = free_port()
        self.client_ttl_s = client_ttl_s
        self.lease_ttl_ms = lease_ttl_ms
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        a = self.address
        return [
            str(self.binary),
            f"--rpc_address={a.host}",
            f"--rpc_port={a.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={a.host}",
            f"--http_metadata_server_port={a.metadata_port}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--logtostderr=true",
        ]

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, ready_timeout_s: float = 30.0) -> MooncakeMaster:
        """Start the master and return once its RPC port and metadata server answer;
        `MasterUnavailable` (with its log's tail) when it exits first or is not ready in time."""
        if self.running():
            return self
        if self.log_path is not None:
            self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C to the parent reaches it through stop()
        )
        deadline = time.monotonic() + ready_timeout_s
        a = self.address
        while not master_answers(a):
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise MasterUnavailable(f"{MASTER_BINARY} exited with {code}{self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise MasterUnavailable(
                    f"{MASTER_BINARY} not ready on {a.rpc} within {ready_timeout_s} s"
                    f"{self._log_tail()}"
                )
            time.sleep(0.02)  # polling a condition: the master binds within ~0.1-1 s
        return self

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_bytes()[-1500:].decode(errors="replace")
        return f"; log {self.log_path}:\n{tail}"

    def kill(self) -> None:
        """SIGKILL the master (what a crash looks like to its clients)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def stop(self, *, grace_s: float = 5.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
