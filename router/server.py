"""Run the router in-process on its own HTTP server (`router.httpserver`, on uvloop when the
caller runs one): `await serve(settings)` until cancelled or signalled, or
`async with running(settings) as url:`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import AsyncIterator
from typing import Any

from ownerserve.config import Settings
from router.app import create_app
from router.httpserver import RouterServer


async def serve(settings: Settings, *, handle_signals: bool = True, **app_kwargs: Any) -> None:
    """Serve until cancelled, or until SIGINT/SIGTERM (then shut down gracefully) when
    `handle_signals` and this is the main thread's loop."""
    app = create_app(settings, **app_kwargs)
    # Everything imported so far lives as long as the process: keep it out of the cyclic
    # collector's full collections, which otherwise rescan it on the request path.
    gc.collect()
    gc.freeze()
    server = RouterServer(app, settings.server.host, settings.server.port)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.shutdown()


@contextlib.asynccontextmanager
async def running(settings: Settings, **app_kwargs: Any) -> AsyncIterator[str]:
    """Start the router on `settings.server.host:port` (0 picks a free port) in this event loop
    and yield its base URL; stop it on exit."""
    app = create_app(settings, **app_kwargs)
    async with running_app(app, settings.server.host, settings.server.port) as url:
        yield url


@contextlib.asynccontextmanager
async def running_app(app: Any, host: str, port: int) -> AsyncIterator[str]:
    """Serve an already built ASGI app (e.g. `create_app(...)`, whose `state.router` a caller
    wants to inspect) in this event loop; yield its base URL."""
    server = RouterServer(app, host, port)
    await server.start()
    try:
        yield f"http://{host}:{server.bound_port}"
    finally:
        await server.shutdown()
