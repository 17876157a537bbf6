"""`ownerserve serve --processes N`: a supervisor that forks N router processes, each listening
on the same port with `SO_REUSEPORT` (the kernel spreads new connections over them), restarts
one that dies (with backoff, logged), forwards SIGTERM/SIGINT to all for a graceful drain, and
exits non-zero when a process keeps failing before it listens. What the processes share and
what each keeps to itself: `docs/ARCHITECTURE.md`, *Several router processes*."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from ownerserve.config import Settings
from ownerserve.errors import ConfigError

log = logging.getLogger("ownerserve.procs")

BACKOFF_S = 0.5
"""A process that died is started again after this, doubled for each death in a row before
it listened, up to `MAX_BACKOFF_S`."""
MAX_BACKOFF_S = 10.0
MAX_START_FAILURES = 5
"""A process that dies this many times in a row before it listens stops the supervisor
(status 1): a config or a port that cannot work is not retried forever."""
STOP_GRACE_S = 15.0
"""After forwarding SIGTERM, how long the supervisor waits for the processes to drain (each
gives its requests `router.server.SHUTDOWN_GRACE_S`) before it kills what is left."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers narrow)."""
    return len(os.sched_getaffinity(0))


def parse_processes(value: str) -> int:
    """`--processes`: a positive count, or `auto` for `usable_cores()`."""
    if value == "auto":
        return usable_cores()
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--processes: {value!r} is not a count or 'auto'") from None
    if n < 1:
        raise ConfigError(f"--processes: {n} must be at least 1")
    return n


def check_shareable(settings: Settings, processes: int) -> None:
    """Several processes must share one ownership directory: with the in-process one each
    would keep its own owners, leases and sessions, and route the same session apart."""
    if processes > 1 and settings.directory.backend != "redis":
        raise ConfigError(
            f"--processes {processes} needs a shared directory: set directory.backend: redis "
            "and directory.redis_url (the in-process 'memory' directory would give each "
            "process its own owners and sessions); or run one process"
        )


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A socket bound (not listening) to `host:port` with `SO_REUSEPORT`, held by the
    supervisor so the port stays the processes' while one restarts; port 0 picks a free one,
    which every process then binds. (The socket, the port.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock, int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the supervisor dies (`PR_SET_PDEATHSIG`), so a
    killed supervisor leaves no router behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class _Child:
    slot: int
    pid: int
    ready_fd: int
    """Read end of the pipe the process writes one byte to once it listens."""
    listening: bool = False
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Keeps `processes` children running `child(slot, ready)` (in a forked process; `ready`
    is called once it listens; its return value is the process's exit status)."""

    def __init__(
        self,
        processes: int,
        child: Callable[[int, Callable[[], None]], int],
        *,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        self.processes = processes
        self.child = child
        self.backoff_s = backoff_s
        self.children: dict[int, _Child] = {}
        self.failures: dict[int, int] = dict.fromkeys(range(processes), 0)
        """Deaths in a row before listening, by slot."""
        self.starts: dict[int, int] = dict.fromkeys(range(processes), 0)
        """Processes started, by slot."""
        self.restart_at: dict[int, float] = {}
        self.restarts = 0
        self.stopping = False

    def run(self) -> int:
        """Start the processes and supervise them until SIGTERM/SIGINT (then 0 once they
        drained) or until one keeps failing at start (then 1)."""
        previous = {
            sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for slot in range(self.processes):
                self._spawn(slot)
            status = self._loop()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _spawn(self, slot: int) -> None:
        read_fd, write_fd = os.pipe()
        self.starts[slot] += 1
        pid = os.fork()
        if pid == 0:  # the router process
            status = 1
            try:
                os.close(read_fd)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                _die_with_parent()

                def ready() -> None:
                    os.write(write_fd, b"1")
                    os.close(write_fd)

                status = self.child(slot, ready)
            except BaseException:
                log.exception("router process %d failed", slot)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        os.close(write_fd)
        self.children[slot] = _Child(slot, pid, read_fd)
        log.info("router process %d started (pid %d)", slot, pid)

    def _loop(self) -> int:
        while not self.stopping:
            waiting = {c.ready_fd: c for c in self.children.values() if not c.listening}
            with contextlib.suppress(InterruptedError):
                readable, _, _ = select.select(list(waiting), [], [], 0.1)
                for fd in readable:
                    child = waiting[fd]
                    if os.read(fd, 1):
                        child.listening = True
                        self.failures[child.slot] = 0
                        log.info("router process %d listening (pid %d)", child.slot, child.pid)
            if self.stopping:
                break
            if not self._reap():
                return 1
            now = time.monotonic()
            for slot, at in list(self.restart_at.items()):
                if now >= at:
                    del self.restart_at[slot]
                    self.restarts += 1
                    self._spawn(slot)
        return 0

    def _reap(self) -> bool:
        """Note the children that exited and schedule their restarts; False when one failed
        at start `MAX_START_FAILURES` times in a row."""
        for child in list(self.children.values()):
            pid, status = os.waitpid(child.pid, os.WNOHANG)
            if pid == 0:
                continue
            del self.children[child.slot]
            os.close(child.ready_fd)
            code = os.waitstatus_to_exitcode(status)
            if not child.listening:
                self.failures[child.slot] += 1
            failures = self.failures[child.slot]
            if failures >= MAX_START_FAILURES:
                log.error(
                    "router process %d exited %d before listening %d times in a row: giving up",
                    child.slot,
                    code,
                    failures,
                )
                return False
            delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** max(0, failures - 1))
            log.warning(
                "router process %d (pid %d) exited %d%s; restarting it in %.1f s",
                child.slot,
                child.pid,
                code,
                "" if child.listening else " before listening",
                delay,
            )
            self.restart_at[child.slot] = time.monotonic() + delay
        return True

    def _stop_all(self) -> None:
        """SIGTERM to every process (each drains its requests), then wait; what is still
        running after `STOP_GRACE_S` is killed."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            for child in list(self.children.values()):
                pid, _ = os.waitpid(child.pid, os.WNOHANG)
                if pid:
                    del self.children[child.slot]
                    os.close(child.ready_fd)
            if self.children:
                time.sleep(0.05)
        for child in self.children.values():
            log.error("router process %d did not drain in time: killed", child.slot)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
            os.close(child.ready_fd)
        self.children.clear()
