"""The router's HTTP/1.1 server: an asyncio protocol with httptools, keep-alive and pipelining.
The completion endpoints go straight to the request path's runner (`router.pipeline.respond`)
with a `ResponseWriter` that writes to the socket (no ASGI messages, no task per request
besides the handler); every other path goes to the ASGI app (FastAPI: health, metrics,
models, admin) through a small ASGI bridge.

Chosen over uvicorn on CPU per request (`bench/router_overhead`, numbers in
bench/history/router_overhead.md).
What it does besides parsing: `TCP_NODELAY` on accepted sockets, `server.max_body_bytes`
enforced while reading (413, then a lingering close: the rest of the body is read and dropped,
within `linger_bytes` and `linger_s`, so that the client can read the 413 before the
connection closes), `Expect: 100-continue`, a HEAD request's answer without content, flow
control on slow readers, idle keep-alive connections closed after `keep_alive_s`, a client that
goes away cancels its request (which cancels upstream work), graceful shutdown, ASGI lifespan.

What it refuses, each in the route's error shape: a request not read whole within
`read_timeout_s` (408), a protocol upgrade (`Upgrade: h2c`, `websocket`: 400), an HTTP/1.0
POST without a length (411: its body would have no end), bytes that do not parse after a
complete request (400, once the requests before them are answered), a connection past
`max_connections` (503) or past `max_connections_per_client` from one address (429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httptools

from ownerserve.config import ServerSettings
from ownerserve.errors import (
    HTTPStatusError,
    InvalidRequestError,
    OwnerServeError,
    PayloadTooLargeError,
)
from ownerserve.http import DRAIN_BYTES, DRAIN_S, error_status_and_body
from ownerserve.tasks import cancel_and_wait
from router.asgi import Message
from router.frontdoors.messages import error_body as messages_error_body
from router.pipeline import respond
from router.requestlog import REQUEST_ID_HEADER, log_refused, request_id
from router.requests import Endpoint
from router.state import Router
from router.upstream import set_no_delay
from router.writer import ResponseWriter

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Request line and headers larger than this get 431 and the connection closes."""
MAX_HEADERS = 100
"""Requests with more header lines than this get 431 too: as many as hyper (behind the Rust
routers) allows. Workers refuse requests with many more in their own error shape, not
OpenAI's (aiohttp past 128)."""

_HOT_PATHS = {e.value.encode(): e for e in Endpoint}
_REASONS = {
    200: b"OK",
    201: b"Created",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    411: b"Length Required",
    413: b"Payload Too Large",
    422: b"Unprocessable Entity",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def _status_line(status: int, http10: bool) -> bytes:
    return b"HTTP/%s %d %s\r\n" % (
        b"1.0" if http10 else b"1.1",
        status,
        _REASONS.get(status, b"Unknown"),
    )


_STATUS_LINES: dict[tuple[int, bool], bytes] = {}
"""`_status_line` by (status, http10), filled as responses go out (a handful of keys)."""


@dataclass(slots=True)  # not frozen: a frozen one's __init__ is slower, once a request
class _Request:
    """One parsed request."""

    method: bytes
    url: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    http10: bool


class _Writer(ResponseWriter):
    """A response written straight to the connection's transport."""

    __slots__ = ("_chunked", "_conn", "_http10", "_keep_alive")

    def __init__(self, conn: _Connection, keep_alive: bool, http10: bool) -> None:
        super().__init__()
        self._conn = conn
        self._keep_alive = keep_alive
        self._http10 = http10
        self._chunked = False

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        self.started = True
        # one loop, no generators: the head of every response is built here (~0.6 µs less)
        line = _STATUS_LINES.get((status, self._http10))
        if line is None:
            line = _STATUS_LINES[(status, self._http10)] = _status_line(status, self._http10)
        parts = [line]
        has_length = False
        for k, v in headers:
            parts.append(b"%s: %s\r\n" % (k, v))
            if k == b"content-length":
                has_length = True
        if not self._keep_alive:
            parts.append(b"connection: close\r\n")
        if body is not None:
            if not has_length:
                parts.append(b"content-length: %d\r\n" % len(body))
            parts.append(b"\r\n")
            if not self.head:
                parts.append(body)
            self.ended = True
        elif has_length or self.head:
            parts.append(b"\r\n")  # the caller declared the length: the body goes as is
        elif self._http10:
            # no chunked encoding in HTTP/1.0: the body ends when the connection closes
            self._keep_alive = False
            self._conn.keep_alive = False
            parts.append(b"\r\n")
        else:
            self._chunked = True
            parts.append(b"transfer-encoding: chunked\r\n\r\n")
        conn = self._conn
        if not conn.closed:
            conn.transport.write(b"".join(parts))
            if conn.write_paused:
                await conn.drain()

    async def write(self, chunk: bytes) -> None:
        conn = self._conn
        if not chunk or conn.closed:
            return
        if self._chunked:
            conn.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        else:
            conn.transport.write(chunk)
        if conn.write_paused:
            await conn.drain()

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        conn = self._conn
        if self._chunked and not conn.closed:
            conn.transport.write(b"0\r\n\r\n")

    direct = True
    head = False
    """Whether this answers a HEAD request (`_HeadWriter`)."""

    def write_nowait(self, chunk: bytes) -> bool:
        conn = self._conn
        if chunk and not conn.closed:
            if self._chunked:
                conn.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                conn.transport.write(chunk)
        return conn.write_paused and not conn.closed

    async def drain(self) -> None:
        await self._conn.drain()


class _HeadWriter(_Writer):
    """The answer to a HEAD request: the status and headers a GET would get, no content (RFC
    9110 §9.3.2; a client reads none, so content sent would be taken for the next response on
    the connection)."""

    __slots__ = ()
    head = True

    async def write(self, chunk: bytes) -> None:
        return

    def write_nowait(self, chunk: bytes) -> bool:
        return False

    async def end(self) -> None:
        self.ended = True


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one at a time (pipelined ones wait)."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.router = server.router
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.closed = False
        self.keep_alive = True
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.writer: ResponseWriter | None = None
        self.pending: deque[_Request] = deque()
        self.last_active = time.monotonic()
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._refused = False
        self._deferred: tuple[int, str, bool] | None = None
        """A refusal that waits for the responses before it (`_refuse`)."""
        self._linger_left = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self.reading_since: float | None = self.last_active
        """When the request being read began (a new connection's first: the connect), None
        between requests: `check_read_deadline`."""
        self._begun = False
        self.peer: str | None = None
        """The client's address, while it counts against `max_connections_per_client`."""

    # --- transport callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        set_no_delay(transport)
        server = self.server
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else ""
        if len(server.connections) >= server.max_connections:
            self._refuse(503, f"more than {server.max_connections} connections open")
            return
        if server.per_client.get(peer, 0) >= server.max_connections_per_client:
            limit = server.max_connections_per_client
            self._refuse(429, f"more than {limit} connections open from one address")
            return
        self.peer = peer
        server.per_client[peer] = server.per_client.get(peer, 0) + 1
        server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._refused:  # lingering: the parser still finds where the refused request ends
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.abort()
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.peer is not None:
            left = self.server.per_client[self.peer] - 1
            if left:
                self.server.per_client[self.peer] = left
            else:
                del self.server.per_client[self.peer]
            self.peer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self.task is not None and not self.task.done():
            if self.writer is not None:
                self.writer.disconnected = True
            self.task.cancel()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    # --- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.reading_since = self.last_active  # set by `data_received`, which calls this
        self._begun = True
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        if self._refused:  # lingering: keep nothing of what follows
            return
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, "request line and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, "request line and headers too large")
            return
        if len(self._headers) >= MAX_HEADERS:
            self._refuse(431, f"more than {MAX_HEADERS} request headers")
            return
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        limit = self.server.max_body_bytes
        framed = False
        for name, value in self._headers:
            if name == b"upgrade":
                self._refuse(400, "protocol upgrades are not supported")
                return
            if name == b"transfer-encoding":
                framed = True
            elif name == b"content-length":
                framed = True
                with contextlib.suppress(ValueError):
                    declared = int(value)
                    if declared > limit:
                        self._refuse(413, f"request body of {declared} bytes exceeds {limit}")
                        return
            elif name == b"expect" and value.lower() == b"100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if (
            not framed
            and self.parser.get_http_version() == "1.0"
            and self.parser.get_method() in (b"POST", b"PUT", b"PATCH")
        ):
            # HTTP/1.1 says such a request has no body; an HTTP/1.0 client sends one anyway
            # and ends it by closing, which leaves no way to answer (RFC 1945 asks for a length)
            self._refuse(411, "a request body needs a Content-Length header")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            self._refuse(413, f"request body exceeds {self.server.max_body_bytes} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.reading_since = None
        self._begun = False
        if self._refused:  # the client sent the refused request whole: closing resets nothing
            if self._deferred is None:
                self.transport.close()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = _Request(
            self.parser.get_method(),
            self._url,
            self._headers,
            body,
            self.parser.should_keep_alive(),
            self.parser.get_http_version() == "1.0",
        )
        if self.task is None:
            self._dispatch(req)
        else:
            self.pending.append(req)
            if len(self.pending) > 8:
                self.transport.pause_reading()

    # --- requests ----------------------------------------------------------------------------

    def _refuse(self, status: int, message: str, linger: bool = True) -> None:
        """Answer an unreadable request with an OpenAI error, then close the connection
        (lingering first, `_linger`, unless `linger` is false). Reading stops here; with
        responses still due (one in flight, pipelined requests before this one), they go
        first and this after them (`_done`)."""
        if self._refused or self.closed:
            return
        self._refused = True
        if self.task is not None:
            self._deferred = (status, message, linger)
            self.transport.pause_reading()
            return
        self.keep_alive = False
        exc: OwnerServeError
        if status == 413:
            exc = PayloadTooLargeError(message)
        elif status == 400:
            exc = InvalidRequestError(message)
        else:
            exc = HTTPStatusError(message, status)
        _, body = error_status_and_body(exc)
        if self._url.split(b"?", 1)[0].startswith(b"/v1/messages"):
            body = messages_error_body(status, message)  # that route's own error shape
        given = next((v for k, v in self._headers if k == REQUEST_ID_HEADER), None)
        rid = request_id(given.decode("latin-1") if given is not None else None)
        head = _status_line(status, False) + (
            b"content-type: application/json\r\nconnection: close\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (rid.encode(), len(body))
        )
        self.transport.write(head + body)
        since = self.reading_since if self.reading_since is not None else self.last_active
        log_refused(rid, status, exc, time.monotonic() - since)
        if linger:
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Close after the answer the way servers do: closing with unread request bytes
        resets the connection, and a client that writes its whole body before it reads
        (`http.client`, so `urllib` and `requests`) then sees the reset, never the answer. So
        half-close (the client reads the answer and EOF), read and drop what the client still
        sends until its request ends, and abort at the server's byte or time bound."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_left = self.server.linger_bytes
        loop = asyncio.get_running_loop()
        self._linger_timer = loop.call_later(self.server.linger_s, self.transport.abort)

    def _dispatch(self, req: _Request) -> None:
        self.keep_alive = req.keep_alive
        path = req.url.split(b"?", 1)[0]
        endpoint = _HOT_PATHS.get(path)
        if endpoint is not None and req.method == b"POST" and self.router is not None:
            writer = _Writer(self, req.keep_alive, req.http10)
            self.writer = writer
            coro: Awaitable[None] = respond(
                self.router, endpoint, req.headers, writer, time.perf_counter(), body=req.body
            )
        else:
            self.writer = None
            coro = self.server.bridge.handle(self, req)
        self.task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.task = None
        writer = self.writer
        self.writer = None
        if not task.cancelled() and task.exception() is not None:
            log.error("request handler failed", exc_info=task.exception())
        complete = writer is None or writer.ended
        if self.closed:
            return
        if not complete or not self.keep_alive:
            self.transport.close()
            return
        self.last_active = time.monotonic()
        if self.pending:
            if len(self.pending) <= 8 and not self._refused:
                self.transport.resume_reading()
            self._dispatch(self.pending.popleft())
        elif self._deferred is not None:
            status, message, linger = self._deferred
            self._deferred = None
            self._refused = False
            self.transport.resume_reading()  # what the client still sends is dropped
            self._refuse(status, message, linger)

    def check_read_deadline(self, began_before: float) -> None:
        """Refuse the request being read if it began before `began_before` (408; a new
        connection that sent nothing is closed without a word)."""
        since = self.reading_since
        if since is None or since >= began_before or self.closed:
            return
        if not self._begun and self.task is None:
            self.transport.close()
            return
        self.reading_since = None
        timeout = self.server.read_timeout_s
        self._refuse(408, f"the request was not read whole within {timeout:g} s", linger=False)

    def close_if_idle(self, idle_before: float) -> None:
        if self.task is None and not self.pending and self.last_active < idle_before:
            self.transport.close()


class _ASGIWriter(ResponseWriter):
    """The ASGI `send` side of a request that the bridge serves (started/ended tracking)."""

    __slots__ = ()


class ASGIBridge:
    """Runs one request through an ASGI app on a `_Connection`."""

    def __init__(self, app: Any, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state

    async def handle(self, conn: _Connection, req: _Request) -> None:
        raw_path, _, query = req.url.partition(b"?")
        sock = conn.transport.get_extra_info("sockname")
        peer = conn.transport.get_extra_info("peername")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if req.http10 else "1.1",
            "method": req.method.decode("latin-1"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": req.headers,
            "client": tuple(peer[:2]) if peer else None,
            "server": tuple(sock[:2]) if sock else None,
            "state": dict(self.state),
        }
        writer = _ASGIWriter()
        conn.writer = writer
        sent_body = False
        status = 500
        headers: list[tuple[bytes, bytes]] = []
        response_done = asyncio.Event()

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await response_done.wait()
            return {"type": "http.disconnect"}

        writer_type = _HeadWriter if req.method == b"HEAD" else _Writer
        chunked = writer_type(conn, req.keep_alive, req.http10)

        async def send(message: Message) -> None:
            nonlocal status, headers
            kind = message["type"]
            if kind == "http.response.start":
                status = int(message["status"])
                headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
                writer.started = True
                return
            if kind != "http.response.body" or writer.ended:
                return
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if not chunked.started:
                if not more:
                    await chunked.start(status, headers, body)
                    writer.ended = True
                    response_done.set()
                    return
                await chunked.start(status, headers)
            await chunked.write(body)
            if not more:
                await chunked.end()
                writer.ended = True
                response_done.set()

        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            if writer.started or chunked.started:
                log.error("ASGI app failed after its response started", exc_info=exc)
                return
            status, body = error_status_and_body(exc)
            await chunked.start(status, [(b"content-type", b"application/json")], body)
            writer.ended = True
        finally:
            response_done.set()
        if not writer.ended:
            if not chunked.started:
                await chunked.start(500, [(b"content-type", b"application/json")], b"")
            writer.ended = True


class RouterServer:
    """Serves an app built by `router.app.create_app` (any ASGI app works; the completion
    endpoints take the direct path when the app has a `state.router`)."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        max_body_bytes: int | None = None,
        keep_alive_s: float = 75.0,
        backlog: int = 4096,
        linger_bytes: int = DRAIN_BYTES,
        linger_s: float = DRAIN_S,
        read_timeout_s: float | None = None,
        max_connections: int | None = None,
        max_connections_per_client: int | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.app = app
        self.reuse_port = reuse_port
        """Bind with `SO_REUSEPORT` (Linux): several processes listen on one port and the
        kernel spreads new connections over them (`router.procs`)."""
        self.router: Router | None = getattr(getattr(app, "state", None), "router", None)
        self.host = host
        self.port = port
        if max_body_bytes is None:
            max_body_bytes = (
                self.router.settings.server.max_body_bytes if self.router else 32 * 1024 * 1024
            )
        self.max_body_bytes = max_body_bytes
        limits = self.router.settings.server if self.router else ServerSettings()
        self.read_timeout_s = limits.read_timeout_s if read_timeout_s is None else read_timeout_s
        self.max_connections = max_connections or limits.max_connections
        self.max_connections_per_client = (
            max_connections_per_client or limits.max_connections_per_client
        )
        self.per_client: dict[str, int] = {}
        """Open connections by client address (those counted in `connections`)."""
        self.keep_alive_s = keep_alive_s
        self.backlog = backlog
        self.linger_bytes = linger_bytes
        self.linger_s = linger_s
        self.connections: set[_Connection] = set()
        self._state: dict[str, Any] = {}
        self.bridge = ASGIBridge(app, self._state)
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._lifespan: _Lifespan | None = None

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Run the app's startup (ASGI lifespan), then listen."""
        self._lifespan = _Lifespan(self.app, self._state)
        await self._lifespan.startup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            self.host,
            self.port,
            backlog=self.backlog,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="router-keepalive-sweep")

    async def _sweep(self) -> None:
        """Every few seconds (a quarter of the shortest bound, at most 5 s): idle keep-alive
        connections closed, requests read too slowly refused."""
        period = min(5.0, self.keep_alive_s, self.read_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            idle_before = now - self.keep_alive_s
            began_before = now - self.read_timeout_s
            for conn in list(self.connections):
                conn.close_if_idle(idle_before)
                conn.check_read_deadline(began_before)

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop listening, let requests in flight finish (up to `grace_s`), close the rest,
        then run the app's shutdown."""
        if self._server is not None:
            self._server.close()
        await cancel_and_wait(self._sweeper)
        for conn in list(self.connections):
            conn.close_if_idle(float("inf"))
        deadline = time.monotonic() + grace_s
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # the grace ran out: what is still running ends with an error (an SSE error event and
        # the stream's end, or a 503), given a moment to write it, then every connection closes
        unfinished = []
        for conn in list(self.connections):
            if conn.task is not None:
                if conn.writer is not None:
                    conn.writer.stopping = True
                conn.task.cancel()
                unfinished.append(conn.task)
        if unfinished:
            await asyncio.wait(unfinished, timeout=STOP_WRITE_S)
        for conn in list(self.connections):
            conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()
        if self._lifespan is not None:
            await self._lifespan.shutdown()


STOP_WRITE_S = 1.0
"""How long requests cancelled at shutdown get to write their error ending."""

SHUTDOWN_TIMEOUT_S = 60.0
"""How long the server waits for the app's lifespan shutdown (the router's close) to finish."""


class _Lifespan:
    """The ASGI lifespan protocol: startup before serving, shutdown after."""

    def __init__(self, app: Any, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self._events: asyncio.Queue[Message] = asyncio.Queue()
        self._startup: asyncio.Future[None] | None = None
        self._shutdown: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._supported = True

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._startup = loop.create_future()
        self._shutdown = loop.create_future()
        self._task = asyncio.create_task(self._run())
        await self._events.put({"type": "lifespan.startup"})
        await asyncio.wait({self._startup, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._startup.done():
            self._startup.result()  # raises if startup failed
        elif self._task.done():
            self._task.result()

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        try:
            await self.app(scope, self._events.get, self._send)
        except Exception as exc:
            if self._startup is not None and not self._startup.done():
                # an app without lifespan support raises on the scope: serve without it
                self._supported = False
                log.debug("app has no lifespan: %r", exc)
                self._startup.set_result(None)
            else:
                log.exception("lifespan failed")

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        futures: dict[str, Callable[[], None]] = {
            "lifespan.startup.complete": lambda: _resolve(self._startup),
            "lifespan.shutdown.complete": lambda: _resolve(self._shutdown),
        }
        if kind in futures:
            futures[kind]()
        elif kind == "lifespan.startup.failed" and self._startup is not None:
            self._startup.set_exception(RuntimeError(message.get("message", "startup failed")))
        elif kind == "lifespan.shutdown.failed" and self._shutdown is not None:
            self._shutdown.set_exception(RuntimeError(message.get("message", "shutdown failed")))

    async def shutdown(self) -> None:
        if self._task is None or self._task.done() or not self._supported:
            return
        await self._events.put({"type": "lifespan.shutdown"})
        assert self._shutdown is not None
        done, _ = await asyncio.wait(
            {self._shutdown, self._task},
            timeout=SHUTDOWN_TIMEOUT_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if not done:  # the app's shutdown hangs: the server still stops
            log.error("the app's shutdown did not finish within %.0f s", SHUTDOWN_TIMEOUT_S)
            return
        if self._shutdown.done() and self._shutdown.exception() is not None:
            log.error("shutdown failed: %s", self._shutdown.exception())


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
