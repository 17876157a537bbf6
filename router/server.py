"""Run the router in-process on its own HTTP server (`router.httpserver`, on uvloop when the
caller runs one): `await serve(settings)` until cancelled or signalled, or
`async with running(settings) as url:` (with `stop_on_signals` to wait for SIGINT/SIGTERM as
`serve` does). Both stop the same way: no new connections, requests in flight (streams
included) get `SHUTDOWN_GRACE_S` to finish."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ownerserve.config import Settings
from router.app import create_app
from router.httpserver import RouterServer

SHUTDOWN_GRACE_S = 5.0
"""How long a stopping server lets requests in flight finish before it closes them."""


async def serve(
    settings: Settings,
    *,
    handle_signals: bool = True,
    reuse_port: bool = False,
    on_listening: Callable[[], None] | None = None,
    **app_kwargs: Any,
) -> None:
    """Serve until cancelled, or until SIGINT/SIGTERM (then shut down gracefully) when
    `handle_signals` and this is the main thread's loop. `reuse_port`: bind with
    `SO_REUSEPORT`, beside the other processes of `ownerserve serve --processes N`;
    `on_listening` is called once the port listens."""
    app = create_app(settings, **app_kwargs)
    # Everything imported so far lives as long as the process: keep it out of the cyclic
    # collector's full collections, which otherwise rescan it on the request path.
    gc.collect()
    gc.freeze()
    server = RouterServer(app, settings.server.host, settings.server.port, reuse_port=reuse_port)
    await server.start()
    if on_listening is not None:
        on_listening()
    stop = asyncio.Event()
    try:
        with stop_on_signals(stop) if handle_signals else contextlib.nullcontext():
            await stop.wait()
    finally:
        await server.shutdown(SHUTDOWN_GRACE_S)


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM set `stop` instead of ending the process (when this is
    the main thread's running loop; elsewhere they keep their handlers). On the way out each
    gets back the handler it had, so a second signal while the server drains does what it did
    before (in `ownerserve serve`: stop at once)."""
    loop = asyncio.get_running_loop()
    installed: list[tuple[signal.Signals, Any]] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append((sig, previous))
    try:
        yield
    finally:
        for sig, previous in installed:
            loop.remove_signal_handler(sig)
            if previous is not None:  # None: not set from Python, left as removal leaves it
                signal.signal(sig, previous)


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
        await server.shutdown(SHUTDOWN_GRACE_S)
