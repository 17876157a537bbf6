"""The completion endpoints under any ASGI server: `handle_completion` reads the body within
`server.max_body_bytes`, watches for the client's disconnect and runs the request pipeline
with an `ASGIResponseWriter` (the router's own server skips this layer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from ownerserve.http import read_request_body
from router.pipeline import respond
from router.requests import Endpoint
from router.writer import ResponseWriter

if TYPE_CHECKING:
    from router.state import Router

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ASGIResponseWriter(ResponseWriter):
    """A `ResponseWriter` over ASGI `send`."""

    __slots__ = ("_send", "watcher")

    def __init__(self, send: Send) -> None:
        super().__init__()
        self._send = send
        self.watcher: asyncio.Task[None] | None = None

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        self.started = True
        if body is not None:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        if body is not None:
            self.ended = True
            await self._send({"type": "http.response.body", "body": body})

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self._send({"type": "http.response.body", "body": b""})

    def detach(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()


async def watch_disconnect(
    receive: Receive, task: asyncio.Task[Any] | None, out: ResponseWriter
) -> None:
    """Cancel the request's task when the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            out.disconnected = True
            if task is not None:
                task.cancel()
            return


async def handle_completion(
    router: Router, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
) -> None:
    """ASGI handler of `/v1/chat/completions` and `/v1/completions`."""
    t0 = time.perf_counter()
    out = ASGIResponseWriter(send)
    task = asyncio.current_task()
    raw_headers: list[tuple[bytes, bytes]] = scope["headers"]

    async def read() -> bytes:
        body = await read_request_body(scope, receive, router.settings.server.max_body_bytes)
        out.watcher = asyncio.create_task(watch_disconnect(receive, task, out))
        return body

    try:
        await respond(router, endpoint, raw_headers, out, t0, read=read)
    finally:
        out.detach()
