"""Runs an emulated engine under uvicorn: the API port, plus the SGLang bootstrap port if set.

Both ports serve the same app (the bootstrap port is where a decode side pulls a room's KV).
`EmulatorServer` starts one inside a running event loop (tests, benchmarks, `ownerserve demo`
style embedding); `run_forever` is the process entry point and handles SIGINT/SIGTERM, and the
end of its launcher's lifeline pipe (`--lifeline-fd`) as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from dataclasses import replace

import uvicorn

from workers.emulator.app import EmulatorApp
from workers.emulator.config import EmulatorConfig


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EmulatorServer:
    """One emulated engine listening on real sockets; port 0 picks free ports."""

    def __init__(self, config: EmulatorConfig, *, embedded: bool = True) -> None:
        self._requested = config
        self._embedded = embedded
        self.config = config
        self.app: EmulatorApp | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sockets: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.public_host}:{self.config.port}"

    def _prepare(self) -> uvicorn.Server:
        c = self._requested
        main = _bind(c.host, c.port)
        self._sockets = [main]
        overrides: dict[str, int] = {"port": main.getsockname()[1]}
        if c.bootstrap_port is not None:
            boot = _bind(c.host, c.bootstrap_port)
            self._sockets.append(boot)
            overrides["bootstrap_port"] = boot.getsockname()[1]
        self.config = replace(c, **overrides)  # type: ignore[arg-type]
        self.app = EmulatorApp(self.config)
        uv = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            http="httptools",
            lifespan="on",
            timeout_keep_alive=75,
            backlog=4096,
            timeout_graceful_shutdown=2,
        )
        self._server = _QuietServer(uv)
        return self._server

    async def start(self) -> None:
        """Bind, start serving in a background task, return once it accepts connections."""
        server = self._prepare()
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=self._sockets))
        while not server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("emulated engine failed to start")
            await asyncio.sleep(0.01)

    def _request_exit(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await self._task
            self._task = None
        for s in self._sockets:
            s.close()
        self._sockets = []

    def _lifeline_ended(self, fd: int) -> None:
        # the launcher never writes: readable is end of file, its last write end is closed
        asyncio.get_running_loop().remove_reader(fd)
        self._request_exit()

    async def serve(self, lifeline_fd: int | None = None) -> None:
        """Serve until SIGINT/SIGTERM (when not embedded) or until `lifeline_fd`, a pipe's read
        end, reaches end of file (its launcher died), then shut down gracefully."""
        server = self._prepare()
        loop = asyncio.get_running_loop()
        if not self._embedded:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._request_exit)
        if lifeline_fd is not None:
            loop.add_reader(lifeline_fd, self._lifeline_ended, lifeline_fd)
        try:
            await server.serve(sockets=self._sockets)
        finally:
            for s in self._sockets:
                s.close()


def run_forever(config: EmulatorConfig, lifeline_fd: int | None = None) -> int:
    """Process entry point: serve `config` on uvloop until a signal arrives or the lifeline
    `lifeline_fd` ends."""
    server = EmulatorServer(config, embedded=False)
    try:
        import uvloop

        uvloop.run(server.serve(lifeline_fd))
    except ImportError:
        asyncio.run(server.serve(lifeline_fd))
    return 0
