"""Run the router in-process with uvicorn tuned for the proxy (uvloop, httptools, no access
log): `await serve(settings)` until cancelled, or `async with running(settings) as url:`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from ownerserve.config import Settings
from router.app import CompletionsASGI, create_app


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=75,
        backlog=4096,
        proxy_headers=False,
    )


def hot_path_first(app: Any) -> Any:
    """The app with the completion endpoints served before FastAPI's middleware stack (the
    app serves them itself too; this only skips layers)."""
    router = getattr(getattr(app, "state", None), "router", None)
    return app if router is None else CompletionsASGI(app, router)


async def serve(settings: Settings, **app_kwargs: Any) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when run from the CLI)."""
    app = create_app(settings, **app_kwargs)
    # Everything imported so far lives as long as the process: keep it out of the cyclic
    # collector's full collections, which otherwise rescan it on the request path.
    gc.collect()
    gc.freeze()
    config = uvicorn_config(hot_path_first(app), settings.server.host, settings.server.port)
    server = uvicorn.Server(config)
    await server.serve()


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
    config = uvicorn_config(hot_path_first(app), host, port)
    config.loop = "none"
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router failed to start")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        await task
