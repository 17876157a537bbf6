"""The router's HTTP/1.1 client to workers: keep-alive connection pools per worker, requests
written in one `write`, responses parsed by httptools and streamed chunk by chunk.

Chosen over aiohttp and httpx on CPU per request (bench/router_overhead/clients.py, numbers in
bench/history/router_overhead.md): the proxy needs only POST/GET with a byte body, a status,
two headers and the body as it arrives. Closing a response before its end closes the
connection, which is how the worker learns that the client went away. Every wait can be
bounded (`Hop`: connect, first byte, a whole answer, the gap between chunks) by one timer per
response; a wait that runs out closes the connection (`UpstreamTimeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlparse

import httptools

MAX_BUFFERED = 1 << 20
"""Bytes buffered per response before the socket stops being read (backpressure)."""


class UpstreamConnectionError(ConnectionError):
    """The connection failed or closed before the response was complete."""


class UpstreamConnectError(UpstreamConnectionError):
    """The connection could not be opened (refused, unreachable)."""


Hop = Literal["connect", "first_byte", "kv_transfer", "stream_gap"]
"""A bounded wait on a worker: opening the connection, the first body bytes of an answer, a
whole KV hand-over answer, the gap between two pieces of a streamed body."""


class UpstreamTimeout(UpstreamConnectionError):
    """A bounded wait on a worker ran out; the connection is closed, which aborts what the
    worker was doing for it."""

    def __init__(self, hop: Hop, timeout_s: float) -> None:
        super().__init__(f"{hop} timed out after {timeout_s:g} s")
        self.hop: Hop = hop
        self.timeout_s = timeout_s


JSON_HEADER = b"content-type: application/json\r\n"
"""The header line of a JSON request body (`header_block`'s format)."""


def header_block(headers: Mapping[str, str]) -> bytes:
    """`name: value\\r\\n` lines for a request."""
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())


def set_no_delay(transport: asyncio.BaseTransport) -> None:
    """`TCP_NODELAY` on a connection's socket: a small answer or request goes out at once."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; it carries one response at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.complete = False
        self.got_bytes = False
        self.error: Exception | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], bool] | None = None
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # the bounded wait in force (`watch`): None, or "first_byte" (ends at the first body
        # bytes), "kv_transfer" (at the end of the response), "stream_gap" (measured from the
        # latest body bytes, `since`)
        self.watching: Hop | None = None
        self.limit_s = 0.0
        self.since = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # --- protocol callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        set_no_delay(transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamConnectionError(f"malformed response: {exc}"))
            self.transport.close()
        sink = self.sink
        if sink is not None and self.chunks:
            # piped: straight to the receiver, one write per read, no task switch
            chunks = self.chunks
            piece = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self.buffered = 0
            if sink(piece) and not self.paused:
                self.paused = True
                self.transport.pause_reading()
                self._wake()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        watching = self.watching
        if watching is not None:
            if watching == "stream_gap":
                self.since = time.monotonic()
            elif watching == "first_byte":
                self.unwatch()
        self.chunks.append(body)
        if self.sink is not None:
            return  # piped: data_received hands what this read brought over in one piece
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if self.watching is not None:
            self.unwatch()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.watching is not None:
            self.unwatch()
        if not self.complete and self.error is None:
            self._fail(UpstreamConnectionError(f"connection lost: {exc!r}" if exc else "closed"))

    # --- bounded waits -----------------------------------------------------------------------

    def watch(self, hop: Hop, limit_s: float) -> None:
        """Bound the wait on this response from now: fail it with `UpstreamTimeout` and close
        the connection when `limit_s` pass before its first body bytes (`first_byte`), its end
        (`kv_transfer`), or between two pieces of its body (`stream_gap`). One timer per
        response, never one per piece: a piece only notes the time (`on_body`); when the
        timer fires early it is set again for the latest piece's deadline."""
        if self.timer is not None:
            self.timer.cancel()
        self.watching = hop
        self.limit_s = limit_s
        self.since = time.monotonic()
        self.timer = asyncio.get_running_loop().call_later(limit_s, self._check)

    def unwatch(self) -> None:
        self.watching = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        hop = self.watching
        if hop is None or self.closed:
            return
        now = time.monotonic()
        if self.paused:
            self.since = now  # the router's own receiver is behind, not the worker
        left = self.since + self.limit_s - now
        if left > 0.0:
            self.timer = asyncio.get_running_loop().call_later(left, self._check)
            return
        self.watching = None
        self._fail(UpstreamTimeout(hop, self.limit_s))
        self.closed = True
        self.transport.close()

    # --- helpers -----------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # nobody may be waiting (an idle connection)
        self._wake()


class UpstreamResponse:
    """A response being received; read it, then `release()` (or `close()` to abort)."""

    __slots__ = ("_conn", "_key", "_pool", "headers", "status")

    def __init__(self, conn: _Connection, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self._conn = conn
        self._pool = pool
        self._key = key
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        for k, v in self.headers:
            if k == name:
                return v
        return default

    @property
    def complete(self) -> bool:
        return self._conn.complete and not self._conn.chunks

    def watch_gaps(self, gap_s: float) -> None:
        """From now until the end of the body, fail reading it (`UpstreamTimeout`, hop
        `stream_gap`) and close the connection when more than `gap_s` pass without body
        bytes while the reader keeps up."""
        conn = self._conn
        if not conn.complete and not conn.closed:
            conn.watch("stream_gap", gap_s)

    async def readany(self) -> bytes:
        """Whatever body bytes arrived (waiting for some); b"" at the end of the body."""
        conn = self._conn
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            conn.waiter = asyncio.get_running_loop().create_future()
            await conn.waiter
        data = conn.chunks.popleft() if len(conn.chunks) == 1 else b"".join(conn.chunks)
        conn.chunks.clear()
        conn.buffered = 0
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
        return data

    async def pipe(
        self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Hand the rest of the body to `sink` as it arrives, from the connection's own
        callback (no task wake-up per chunk); return at its end, raise on a failure.
        `sink` returns True when its receiver is congested: reading pauses until `drain()`."""
        conn = self._conn
        conn.sink = sink
        try:
            if conn.chunks:
                data = b"".join(conn.chunks)
                conn.chunks.clear()
                conn.buffered = 0
                if sink(data) and not conn.paused:
                    conn.paused = True
                    conn.transport.pause_reading()
            while True:
                if conn.error is not None and not conn.complete:
                    raise conn.error
                if conn.complete:
                    return
                if conn.paused:
                    await drain()
                    conn.paused = False
                    if not conn.closed:
                        conn.transport.resume_reading()
                    continue
                conn.waiter = asyncio.get_running_loop().create_future()
                await conn.waiter
        finally:
            conn.sink = None
            if conn.paused and not conn.closed:
                # the body ended while the receiver was congested: a pooled connection must
                # read again
                conn.paused = False
                conn.transport.resume_reading()

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts: list[bytes] = []
        while True:
            chunk = await self.readany()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def release(self) -> None:
        """Give the connection back to the pool if the response was read to its end."""
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self._pool._put(self._key, conn)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (the worker sees the client leave and stops generating)."""
        conn = self._conn
        if not conn.closed:
            conn.closed = True
            conn.transport.close()


class UpstreamPool:
    """Keep-alive connections to every worker, by (host, port)."""

    def __init__(self, connect_timeout_s: float = 3.0, max_idle_per_host: int = 512) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._addrs: dict[str, tuple[str, int, bytes]] = {}

    def _addr(self, base_url: str) -> tuple[str, int, bytes]:
        addr = self._addrs.get(base_url)
        if addr is None:
            u = urlparse(base_url)
            host = u.hostname or "127.0.0.1"
            port = u.port or (443 if u.scheme == "https" else 80)
            addr = self._addrs[base_url] = (host, port, f"{host}:{port}".encode())
        return addr

    def _put(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle:
            conn.closed = True
            conn.transport.close()
            return
        conn._reset()
        idle.append(conn)

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, host, port)
        except TimeoutError:  # also the kernel's own connect timeout (ETIMEDOUT)
            raise UpstreamTimeout("connect", self.connect_timeout_s) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    async def request(
        self,
        base_url: str,
        method: bytes,
        path: str,
        headers: bytes = b"",
        body: bytes = b"",
        bound: tuple[Hop, float] | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the response headers arrived. `headers` are
        ready-made header lines (see `header_block`). `bound`: (hop, seconds) from sending it
        (`_Connection.watch`; `first_byte` or `kv_transfer`), besides the connect timeout."""
        host, port, host_header = self._addr(base_url)
        key = (host, port)
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            method,
            path.encode(),
            host_header,
            len(body),
            headers,
        )
        idle = self._idle.get(key)
        while True:
            fresh = not idle
            if idle:
                conn = idle.pop()
                if conn.closed:
                    continue
            else:
                conn = await self._connect(host, port)
            if bound is not None:
                conn.watch(bound[0], bound[1])
            conn.transport.write(head + body if body else head)
            try:
                await conn.headers_done
            except UpstreamConnectionError as exc:
                conn.closed = True
                conn.transport.close()
                # a kept-alive connection the worker closed meanwhile: retry on a new one
                if not fresh and not conn.got_bytes and not isinstance(exc, UpstreamTimeout):
                    continue
                raise
            except BaseException:
                conn.closed = True
                conn.transport.close()
                raise
            return UpstreamResponse(conn, self, key)

    async def call(
        self,
        base_url: str,
        method: bytes,
        path: str,
        headers: bytes = b"",
        body: bytes = b"",
        bound: tuple[Hop, float] | None = None,
    ) -> tuple[int, bytes]:
        """`request`, then its whole answer: (status, body). The connection goes back to the
        pool once the body is read, else it is closed (an `OSError` while reading passes
        through, as one from `request` does)."""
        resp = await self.request(base_url, method, path, headers, body, bound)
        try:
            data = await resp.read()
        finally:
            resp.release()
        return resp.status, data

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                if not conn.closed:
                    conn.closed = True
                    conn.transport.close()
        self._idle.clear()
