"""The router's HTTP/1.1 client against real servers: keep-alive reuse, a stale pooled
connection retried, refused connections, bodies streamed as they arrive, truncated bodies, and
each bounded wait (connect, first byte, KV transfer, stream gap) against a server that stalls."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from router.upstream import (
    Hop,
    UpstreamConnectionError,
    UpstreamPool,
    UpstreamTimeout,
    header_block,
)
from tests.router.fake_worker import FakeWorker, free_port
from tests.router.waiting import cancel_once_started
from tests.waiting import BOUND_S, until

HEADERS = header_block({"content-type": "application/json"})


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool()
    yield p
    await p.close()


async def _raw_server(handler) -> tuple[asyncio.AbstractServer, str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


async def test_keep_alive_reuses_one_connection_and_streams_sse(pool: UpstreamPool):
    worker = await FakeWorker("w").start()
    try:
        for _ in range(3):
            resp = await pool.request(worker.url, b"POST", "/v1/completions", HEADERS,
                                      b'{"model": "m", "prompt": "x"}')  # fmt: skip
            assert resp.status == 200 and b"hello from w" in await resp.read()
            resp.release()
        assert sum(len(c) for c in pool._idle.values()) == 1
        resp = await pool.request(worker.url, b"POST", "/v1/completions", HEADERS,
                                  b'{"model": "m", "prompt": "x", "stream": true}')  # fmt: skip
        assert resp.header(b"content-type").startswith(b"text/event-stream")
        chunks = []
        while chunk := await resp.readany():
            chunks.append(chunk)
        resp.release()
        assert len(chunks) >= 2 and b"[DONE]" in chunks[-1]
    finally:
        await worker.stop()


async def test_refused_connection_raises_a_connection_error():
    pool = UpstreamPool(connect_timeout_s=1.0)
    with pytest.raises(UpstreamConnectionError):
        await pool.request(f"http://127.0.0.1:{free_port()}", b"GET", "/health")


async def test_a_pooled_connection_closed_by_the_server_is_not_used_again(pool: UpstreamPool):
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive promised, then closed: a stale pooled connection

    server, url = await _raw_server(handler)
    try:
        first = await pool.request(url, b"GET", "/health")
        assert await first.read() == b"ok"
        first.release()
        await until(lambda: first._conn.closed, what="the pool seeing the server's close")
        again = await pool.request(url, b"GET", "/health")
        assert await again.read() == b"ok"
        assert again._conn is not first._conn
        again.release()
        assert served == 2
    finally:
        server.close()


async def test_a_pooled_connection_closed_as_a_request_goes_out_is_retried_on_a_new_one(
    pool: UpstreamPool,
):
    """The worker closes an idle kept-alive connection just as the router sends on it (its
    idle timeout ran out): the request is sent again on a new connection."""
    served = dropped = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served, dropped
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")  # the next request on this connection...
            dropped += 1
        writer.close()  # ... is never answered

    server, url = await _raw_server(handler)
    try:
        first = await pool.request(url, b"GET", "/health")
        assert await first.read() == b"ok"
        first.release()
        again = await pool.request(url, b"GET", "/health")
        assert await again.read() == b"ok"
        assert again._conn is not first._conn
        again.release()
        assert (served, dropped) == (2, 1)
    finally:
        server.close()


async def test_a_body_cut_short_raises_instead_of_ending_quietly(pool: UpstreamPool):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.transport.abort()

    server, url = await _raw_server(handler)
    try:
        resp = await pool.request(url, b"GET", "/stream")
        assert await resp.readany() == b"hello"
        with pytest.raises(UpstreamConnectionError):
            await resp.readany()
    finally:
        server.close()


async def test_closing_a_response_early_tells_the_server(pool: UpstreamPool):
    worker = await FakeWorker("w", mode="hang").start()
    try:
        task = asyncio.create_task(pool.request(worker.url, b"POST", "/v1/completions", HEADERS,
                                                b'{"model": "m", "prompt": "x"}'))  # fmt: skip
        await cancel_once_started(task, worker)
    finally:
        await worker.stop()


async def test_tcp_nodelay_on_upstream_and_accepted_sockets(pool: UpstreamPool):
    import gc
    import socket

    from ownerserve.config import settings_from_dict
    from router.app import create_app
    from router.httpserver import _Connection as HttpToolsProtocol
    from router.server import running_app

    worker = await FakeWorker("w").start()
    settings = settings_from_dict(
        {
            "server": {"port": 0},
            "models": [{"name": "m"}],
            "workers": [{"id": "w", "url": worker.url}],
        }
    )
    try:
        resp = await pool.request(worker.url, b"GET", "/health")
        await resp.read()
        sock = resp._conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        resp.release()
        async with running_app(create_app(settings), "127.0.0.1", 0) as url:
            reader, writer = await asyncio.open_connection(*url[7:].split(":"))
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            accepted = [
                o.transport.get_extra_info("socket")
                for o in gc.get_objects()
                # type(), not isinstance(): that reads `__class__`, which warns on some
                # deprecated module attributes (torch's)
                if type(o) is HttpToolsProtocol and o.transport is not None and not o.closed
            ]
            assert accepted
            assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)
            writer.close()
    finally:
        await worker.stop()


async def test_pipe_pauses_reading_while_the_receiver_is_congested(pool: UpstreamPool):
    worker = await FakeWorker("w").start()
    try:
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
        resp = await pool.request(
            worker.url, b"POST", "/v1/chat/completions", header_block({"x": "y"}), body
        )
        got: list[bytes] = []
        reading_while_drained: list[bool] = []

        def sink(chunk: bytes) -> bool:
            got.append(chunk)
            return True  # always congested: every piece is followed by a drain

        async def drain() -> None:
            reading_while_drained.append(resp._conn.transport.is_reading())
            await asyncio.sleep(0.01)

        await resp.pipe(sink, drain)
        assert reading_while_drained and not any(reading_while_drained)
        assert b"".join(got).rstrip().endswith(b"data: [DONE]")
        resp.release()
        # the connection went back to the pool reading again: the next request works on it
        again = await pool.request(worker.url, b"GET", "/health")
        assert again._conn is resp._conn
        assert again.status == 200
        await again.read()
        again.release()
    finally:
        await worker.stop()


# --- bounded waits: each against a real socket server that stalls where the test says --------

SLACK_S = 10.0
"""How far past its bound a wait may end here: a busy machine may add seconds, not tens of
them; the stalls themselves last 60 s (or for good)."""


async def _stalling_server(
    *parts: bytes, then_wait_s: float = 60.0
) -> tuple[asyncio.AbstractServer, str, asyncio.Event]:
    """Answers every request with `parts` (0.05 s apart), then sends nothing more; the event
    is set once the router's side closed the connection."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(then_wait_s):
                await reader.read()  # b"" once the client closed
            closed.set()
        finally:
            writer.close()

    server, url = await _raw_server(handler)
    return server, url, closed


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.parametrize(
    ("head", "hop", "bound_s", "read"),
    [
        # headers come at once, as vLLM sends them for a stream, but no body: the bound is on
        # the first body bytes
        (SSE_HEAD, "first_byte", 0.3, "readany"),
        # headers and half the body in time, the rest never: a KV hand-over must be whole
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", "kv_transfer", 0.4, "read"),
    ],
)
async def test_a_bound_that_runs_out_times_out_and_closes_the_connection(
    pool: UpstreamPool, head: bytes, hop: Hop, bound_s: float, read: str
):
    server, url, closed = await _stalling_server(head)
    try:
        t0 = time.monotonic()
        resp = await pool.request(url, b"POST", "/v1/completions", HEADERS, b"{}", (hop, bound_s))
        with pytest.raises(UpstreamTimeout) as err:
            await getattr(resp, read)()
        assert err.value.hop == hop
        # at the bound, long before the server's own 60 s wait ends (a busy machine may add
        # seconds to the bound, not tens of them)
        assert bound_s <= time.monotonic() - t0 < bound_s + SLACK_S
        async with asyncio.timeout(BOUND_S):
            await closed.wait()  # the worker sees the request abandoned
    finally:
        server.close()


async def test_first_bytes_in_time_end_the_first_byte_bound(pool: UpstreamPool):
    server, url, _ = await _stalling_server(SSE_HEAD + _chunk(b"data: 1\n\n"))
    try:
        resp = await pool.request(url, b"POST", "/v1/completions", HEADERS, b"{}",
                                  ("first_byte", 0.3))  # fmt: skip
        assert await resp.readany() == b"data: 1\n\n"
        # no bound any more: the read is still waiting well after 0.3 s
        pending = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0.6)
        assert not pending.done()
        pending.cancel()
        resp.close()
    finally:
        server.close()


async def test_a_stalled_stream_fails_after_the_gap_but_a_steady_one_does_not(pool: UpstreamPool):
    # one every 0.05 s, ten times within the gap (a busy machine's pauses stay well inside it)
    steady = [_chunk(b"data: %d\n\n" % i) for i in range(16)]
    gap_s = 0.5
    server, url, closed = await _stalling_server(SSE_HEAD, *steady)
    try:
        resp = await pool.request(url, b"POST", "/v1/completions", HEADERS, b"{}")
        resp.watch_gaps(gap_s)
        got: list[bytes] = []
        t_last = time.monotonic()

        def sink(chunk: bytes) -> bool:
            nonlocal t_last
            got.append(chunk)
            t_last = time.monotonic()
            return False

        async def drain() -> None:
            pass

        with pytest.raises(UpstreamTimeout) as err:
            await resp.pipe(sink, drain)
        assert err.value.hop == "stream_gap"
        assert b"data: 15" in b"".join(got)  # 0.8 s of steady chunks passed the 0.5 s bound
        assert gap_s <= time.monotonic() - t_last < gap_s + SLACK_S
        async with asyncio.timeout(BOUND_S):
            await closed.wait()
    finally:
        server.close()


async def test_the_stream_gap_does_not_count_while_the_router_waits_on_its_client(
    pool: UpstreamPool,
):
    parts = [_chunk(b"data: %d\n\n" % i) for i in range(3)]
    server, url, _ = await _stalling_server(SSE_HEAD, *parts, _chunk(b""), then_wait_s=5.0)
    try:
        resp = await pool.request(url, b"POST", "/v1/completions", HEADERS, b"{}")
        resp.watch_gaps(0.2)
        got: list[bytes] = []

        def sink(chunk: bytes) -> bool:
            got.append(chunk)
            return True  # congested after every piece

        async def drain() -> None:
            await asyncio.sleep(0.5)  # a slow client: longer than the gap each time

        await resp.pipe(sink, drain)  # ends normally: no timeout
        assert b"data: 2" in b"".join(got)
        resp.release()
    finally:
        server.close()


async def test_a_connect_that_gets_no_answer_times_out():
    # a listener whose accept queue is full: the kernel drops further SYNs, so connecting
    # hangs (a worker host that stopped answering)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=1.0)
    pool = UpstreamPool(connect_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout) as err:
            await pool.request(f"http://127.0.0.1:{listener.getsockname()[1]}", b"GET", "/")
        assert err.value.hop == "connect"
        # its own bound, not the pool's default (3 s)
        assert 0.3 <= time.monotonic() - t0 < 2.5
    finally:
        filler.close()
        listener.close()
        await pool.close()
