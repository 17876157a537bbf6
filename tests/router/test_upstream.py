"""The router's HTTP/1.1 client against real servers: keep-alive reuse, a stale pooled
connection retried, refused connections, bodies streamed as they arrive, truncated bodies."""

from __future__ import annotations

import asyncio

import pytest

from router.upstream import UpstreamConnectionError, UpstreamPool, header_block
from tests.router.fake_worker import FakeWorker, free_port

HEADERS = header_block({"content-type": "application/json"})


async def _raw_server(handler) -> tuple[asyncio.AbstractServer, str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


async def test_keep_alive_reuses_one_connection_and_streams_sse():
    worker = await FakeWorker("w").start()
    pool = UpstreamPool()
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
        await pool.close()
        await worker.stop()


async def test_refused_connection_raises_a_connection_error():
    pool = UpstreamPool(connect_timeout_s=1.0)
    with pytest.raises(UpstreamConnectionError):
        await pool.request(f"http://127.0.0.1:{free_port()}", b"GET", "/health")


async def test_a_pooled_connection_closed_by_the_server_is_retried_on_a_new_one():
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive promised, then closed: a stale pooled connection

    server, url = await _raw_server(handler)
    pool = UpstreamPool()
    try:
        for _ in range(2):
            resp = await pool.request(url, b"GET", "/health")
            assert await resp.read() == b"ok"
            resp.release()
            await asyncio.sleep(0.05)
        assert served == 2
    finally:
        await pool.close()
        server.close()


async def test_a_body_cut_short_raises_instead_of_ending_quietly():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.transport.abort()

    server, url = await _raw_server(handler)
    pool = UpstreamPool()
    try:
        resp = await pool.request(url, b"GET", "/stream")
        assert await resp.readany() == b"hello"
        with pytest.raises(UpstreamConnectionError):
            await resp.readany()
    finally:
        await pool.close()
        server.close()


async def test_closing_a_response_early_tells_the_server():
    worker = await FakeWorker("w", mode="hang").start()
    pool = UpstreamPool()
    try:
        task = asyncio.create_task(pool.request(worker.url, b"POST", "/v1/completions", HEADERS,
                                                b'{"model": "m", "prompt": "x"}'))  # fmt: skip
        for _ in range(100):
            if worker.completions():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(5.0):
            await worker.cancelled.wait()
    finally:
        await pool.close()
        await worker.stop()


async def test_tcp_nodelay_on_upstream_and_accepted_sockets():
    import gc
    import socket

    from ownerserve.config import settings_from_dict
    from router.app import create_app
    from router.httpserver import _Connection as HttpToolsProtocol
    from router.server import running_app

    worker = await FakeWorker("w").start()
    pool = UpstreamPool()
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
        await pool.close()
        await worker.stop()


async def test_pipe_pauses_reading_while_the_receiver_is_congested():
    worker = await FakeWorker("w").start()
    pool = UpstreamPool()
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
        await pool.close()
        await worker.stop()
