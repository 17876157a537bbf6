"""The router's own HTTP/1.1 server at the byte level (raw sockets, a real `FakeWorker`
behind it): keep-alive and pipelining, chunked streaming, HTTP/1.0, `Expect: 100-continue`,
bodies over the limit refused while reading (and the refused body read and dropped, within
bounds, so that clients that write it whole before reading get the 413), malformed requests,
the ASGI bridge's routes, and the ASGI handler of the same core under another server (httpx's
ASGI transport)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from ownerserve.config import settings_from_dict
from router.app import create_app
from router.httpserver import RouterServer
from router.server import running_app
from tests.big_body import body_of_64_mib, urllib_post
from tests.router.fake_worker import FakeWorker
from tests.waiting import until

MODEL = "tiny"


def _chat(stream: bool = False) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30}]}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def _post(body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/%s\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (version, extra, len(body), body)
    )


@contextlib.asynccontextmanager
async def served(**server: Any) -> AsyncIterator[tuple[str, int, Any]]:
    worker = await FakeWorker("w0").start()
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60, **server},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": worker.url, "role": "hybrid", "kind": "vllm"}],
        }
    )
    app = create_app(settings)
    try:
        async with running_app(app, "127.0.0.1", 0) as url:
            host, port = url[7:].split(":")
            yield host, int(port), app
    finally:
        await worker.stop()


@contextlib.asynccontextmanager
async def lingering(linger_bytes: int, linger_s: float) -> AsyncIterator[int]:
    """A router server (no workers: nothing gets that far) with these lingering bounds and a
    64 KiB body limit; yields its port."""
    settings = settings_from_dict(
        {"server": {"port": 0, "max_body_bytes": 1 << 16}, "models": [{"name": MODEL}]}
    )
    server = RouterServer(
        create_app(settings), "127.0.0.1", 0, linger_bytes=linger_bytes, linger_s=linger_s
    )
    await server.start()
    try:
        yield server.bound_port
    finally:
        await server.shutdown()


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers, body (content-length, chunked, or until EOF)."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        body = b"".join(parts)
    else:
        async with asyncio.timeout(10):
            body = await reader.read()
    return status, headers, body


async def test_keep_alive_serves_pipelined_requests_in_order():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat()) + b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" + _post(_chat()))
        got = [await _response(reader) for _ in range(3)]
        assert [s for s, _, _ in got] == [200, 200, 200]
        assert orjson.loads(got[0][2])["object"] == "chat.completion"
        assert "x-ownerserve-plan" in got[0][1]
        assert orjson.loads(got[1][2])["status"] == "ok"
        assert orjson.loads(got[2][2])["object"] == "chat.completion"
        writer.close()


async def test_a_stream_is_chunked_on_http11_and_ends_with_done():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat(stream=True)))
        status, headers, body = await _response(reader)
        assert status == 200
        assert headers["transfer-encoding"] == "chunked"
        assert headers["content-type"].startswith("text/event-stream")
        assert body.rstrip().endswith(b"data: [DONE]")
        writer.write(_post(_chat()))  # the connection stays usable
        assert (await _response(reader))[0] == 200
        writer.close()


async def test_http10_gets_an_unchunked_body_and_the_connection_closes():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat(stream=True), version=b"1.0"))
        status, headers, body = await _response(reader)
        assert status == 200 and "transfer-encoding" not in headers
        assert body.rstrip().endswith(b"data: [DONE]")
        assert reader.at_eof()
        writer.close()


async def test_expect_100_continue_is_answered_before_the_body():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        body = _chat()
        head, _, _ = _post(body, b"expect: 100-continue\r\n").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        async with asyncio.timeout(10):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100")
        writer.write(body)
        assert (await _response(reader))[0] == 200
        writer.close()


JSON_CONTENT = {"content-type": "application/json"}


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_gets_413_while_reading(declared: bool):
    async with served(max_body_bytes=1024) as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        big = orjson.dumps({"model": MODEL, "prompt": "x" * 4096})
        if declared:
            writer.write(_post(big))
        else:  # chunked upload: no length to check up front
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
            )
        status, headers, body = await _response(reader)
        assert status == 413
        assert orjson.loads(body)["error"]["type"]
        assert headers["connection"] == "close"
        writer.close()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_64_mib_body_from_urllib_gets_the_413_not_a_reset(declared: bool):
    body = body_of_64_mib(declared)
    async with served() as (host, port, _):  # the default limit: 32 MiB
        url = f"http://{host}:{port}/v1/chat/completions"
        status, answer = await asyncio.to_thread(urllib_post, url, body, JSON_CONTENT)
    assert status == 413
    assert orjson.loads(answer)["error"]["code"] == "payload_too_large"


async def _flood_after_refusal(port: int, pause_s: float) -> tuple[bytes, float]:
    """Declare a 1 TiB body and send it without end (1 KiB every `pause_s`, or as fast as the
    socket takes it); returns the answer's head and how long after it the router kept taking
    the body before the connection broke."""
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n"
        await loop.sock_sendall(sock, head % (1 << 40))
        async with asyncio.timeout(10):
            answer = await loop.sock_recv(sock, 4096)
        answered = time.monotonic()
        chunk = b"x" * (1024 if pause_s else 1 << 16)
        with pytest.raises(OSError):  # reset or broken pipe: the router closed
            async with asyncio.timeout(30):
                while True:
                    await loop.sock_sendall(sock, chunk)
                    await asyncio.sleep(pause_s)
        return answer, time.monotonic() - answered


async def test_a_client_sending_forever_is_cut_off_at_the_byte_bound():
    async with lingering(linger_bytes=4 << 20, linger_s=60) as port:
        answer, kept_s = await _flood_after_refusal(port, pause_s=0)
    assert answer.startswith(b"HTTP/1.1 413")
    assert kept_s < 10  # far below the time bound: the 4 MiB did it


async def test_a_client_trickling_forever_is_cut_off_at_the_time_bound():
    async with lingering(linger_bytes=1 << 40, linger_s=1.0) as port:
        answer, kept_s = await _flood_after_refusal(port, pause_s=0.02)
    assert answer.startswith(b"HTTP/1.1 413")
    # the body was taken for about the linger time (counted from the refusal, which the
    # client reads a moment later), then no longer (the client would send for 30 s)
    assert 0.5 < kept_s < 15


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (b"x-big: " + b"a" * (70 << 10) + b"\r\n", "too large"),
        (b"".join(b"x-h%d: v\r\n" % i for i in range(120)), "more than 100 request headers"),
    ],
    ids=["bytes", "count"],
)
async def test_too_many_header_bytes_or_lines_get_431_in_the_openai_shape(
    extra: bytes, fragment: str
):
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat(), extra))
        status, headers, body = await _response(reader)
        assert status == 431 and headers["connection"] == "close"
        assert fragment in orjson.loads(body)["error"]["message"]
        writer.close()
        reader, writer = await asyncio.open_connection(host, port)  # 100 lines still pass
        writer.write(_post(_chat(), b"".join(b"x-h%d: v\r\n" % i for i in range(97))))
        status, _, _ = await _response(reader)
        assert status == 200
        writer.close()


async def test_a_malformed_request_gets_400_and_the_connection_closes():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, body = await _response(reader)
        assert status == 400
        assert "error" in orjson.loads(body)
        writer.close()


@pytest.mark.parametrize(
    "upgrade",
    [
        b"upgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\nhttp2-settings: AAMAAABkAAQ\r\n",
        b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n",
    ],
    ids=["h2c", "websocket"],
)
async def test_a_protocol_upgrade_gets_400_not_an_empty_reply(upgrade: bytes):
    async with served() as (host, port, _):
        for request in (
            _post(_chat(), upgrade),
            b"GET /health HTTP/1.1\r\nhost: t\r\n" + upgrade + b"\r\n",
        ):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            status, headers, body = await _response(reader)
            assert status == 400 and headers["connection"] == "close"
            assert "upgrade" in orjson.loads(body)["error"]["message"]
            writer.close()


async def test_bytes_that_do_not_parse_after_a_request_get_400_after_its_answer():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat()) + _post(_chat()) + b"\x00\x01 garbage \r\n\r\n")
        first, second, third = [await _response(reader) for _ in range(3)]
        assert first[0] == second[0] == 200
        assert orjson.loads(second[2])["object"] == "chat.completion"
        assert third[0] == 400 and third[1]["connection"] == "close"
        assert "malformed" in orjson.loads(third[2])["error"]["message"]
        writer.close()


async def test_an_http10_post_without_a_length_gets_411():
    async with served() as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nhost: t\r\n\r\n" + _chat())
        writer.write_eof()  # an HTTP/1.0 body ends where the connection does
        status, _, body = await _response(reader)
        assert status == 411
        assert "Content-Length" in orjson.loads(body)["error"]["message"]
        writer.close()


async def test_a_request_read_too_slowly_gets_408_and_a_silent_connection_is_closed():
    async with served(read_timeout_s=0.5) as (host, port, _):
        reader, writer = await asyncio.open_connection(host, port)
        request = _post(_chat())

        async def trickle() -> None:  # a byte every 0.1 s: ~20 s for the whole request
            with contextlib.suppress(OSError):
                for i in range(len(request)):
                    writer.write(request[i : i + 1])
                    await asyncio.sleep(0.1)

        client = asyncio.create_task(trickle())
        try:
            status, headers, body = await _response(reader)
            assert not client.done()  # refused while the request was still coming
        finally:
            client.cancel()
        assert status == 408 and headers["connection"] == "close"
        assert orjson.loads(body)["error"]["message"].startswith("the request was not read")
        writer.close()
        # a connection that never sends a byte is closed, without an answer
        reader, writer = await asyncio.open_connection(host, port)
        async with asyncio.timeout(30):
            assert await reader.read() == b""
        writer.close()


@pytest.mark.parametrize(
    "limits, status",
    [({"max_connections_per_client": 2}, 429), ({"max_connections": 2}, 503)],
    ids=["per-client", "total"],
)
async def test_connections_past_a_limit_are_refused_and_room_comes_back(
    limits: dict[str, int], status: int
):
    async with served(**limits) as (host, port, _):
        held = [await asyncio.open_connection(host, port) for _ in range(2)]
        for reader, writer in held:  # both are served
            writer.write(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
            assert (await _response(reader))[0] == 200
        reader, writer = await asyncio.open_connection(host, port)
        got, headers, body = await _response(reader)
        assert got == status and headers["connection"] == "close"
        assert "connections open" in orjson.loads(body)["error"]["message"]
        writer.close()
        held[0][1].close()
        await held[0][1].wait_closed()

        async def served_again() -> bool:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
                return (await _response(reader))[0] == 200
            finally:
                writer.close()

        await until(served_again, what="a connection served once one closed")
        held[1][1].close()


async def test_asgi_bridge_serves_the_other_routes_with_openai_errors():
    async with (
        served() as (host, port, _),
        httpx.AsyncClient(base_url=f"http://{host}:{port}") as c,
    ):
        assert (await c.get("/metrics")).text.startswith("#")
        missing = await c.get("/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        assert (await c.head("/health")).status_code == 200
        slash = await c.get("/health/", headers={"host": "elsewhere.example"})
        assert slash.status_code == 404 and "location" not in slash.headers  # no redirect
        for path in ("/v1/chat/completions", "/v1/completions"):  # POST only
            wrong = await c.get(path)
            assert wrong.status_code == 405, path
            assert wrong.json()["error"]["code"] == "method_not_allowed"


async def test_the_completion_core_also_serves_under_any_asgi_server():
    worker = await FakeWorker("w0").start()
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": worker.url, "role": "hybrid", "kind": "vllm"}],
        }
    )
    app = create_app(settings)
    try:
        await app.state.router.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            ok = await c.post("/v1/chat/completions", content=_chat())
            assert ok.status_code == 200 and "x-ownerserve-plan" in ok.headers
            streamed = await c.post("/v1/chat/completions", content=_chat(stream=True))
            assert streamed.text.rstrip().endswith("data: [DONE]")
            bad = await c.post("/v1/chat/completions", content=b"{")
            assert bad.status_code == 400 and bad.json()["error"]["type"]
    finally:
        await app.state.router.close()
        await worker.stop()


class _FloodWorker:
    """A worker that answers every completion with a large SSE stream written as fast as the
    socket takes it (numbered events, then `[DONE]`), and notes when a client goes away."""

    EVENTS = 40000  # ~2.4 MB

    def __init__(self, endless: bool = False) -> None:
        self.endless = endless
        self.port = 0
        self.aborted = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                batch = []
                i = 0
                while i < self.EVENTS or self.endless:
                    batch.append(b'data: {"n":%d}\n\n' % i)
                    i += 1
                    if len(batch) == 500:
                        data = b"".join(batch)
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                        batch = []
                        await writer.drain()
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.aborted.set()
        finally:
            writer.close()

    async def __aenter__(self) -> _FloodWorker:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


@contextlib.asynccontextmanager
async def _flood_router(endless: bool = False) -> AsyncIterator[tuple[_FloodWorker, str, int]]:
    async with _FloodWorker(endless) as flood:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 60},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "f", "url": f"http://127.0.0.1:{flood.port}", "kind": "vllm"}],
            }
        )
        async with running_app(create_app(settings), "127.0.0.1", 0) as url:
            host, port = url[7:].split(":")
            yield flood, host, int(port)


async def test_a_slow_reader_gets_a_large_stream_whole_and_in_order():
    """The piped stream with a client that stops reading for a while (a small receive
    buffer, so the router's writes back up): everything arrives, in order."""
    async with _flood_router() as (_, host, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        writer.write(_post(_chat(stream=True)))
        await asyncio.sleep(0.5)  # not reading: the router must hold back, not buffer it all
        status, _, body = await _response(reader)
        assert status == 200
        events = body.split(b"\n\n")
        numbers = [orjson.loads(e[6:])["n"] for e in events if e.startswith(b'data: {"n"')]
        assert numbers == list(range(_FloodWorker.EVENTS))
        assert body.rstrip().endswith(b"data: [DONE]")
        writer.close()


async def test_a_client_leaving_mid_stream_closes_the_worker_connection():
    async with _flood_router(endless=True) as (flood, host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_post(_chat(stream=True)))
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(4096)  # the stream is flowing
        writer.transport.abort()
        async with asyncio.timeout(10):
            await flood.aborted.wait()


async def test_a_stream_still_running_when_the_grace_runs_out_ends_with_an_error_event():
    worker = await FakeWorker("w0", mode="slow", chunks=1000).start()
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": worker.url, "role": "hybrid", "kind": "vllm"}],
        }
    )
    server = RouterServer(create_app(settings), "127.0.0.1", 0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port)
        writer.write(_post(_chat(stream=True)))
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            await reader.readuntil(b"data: ")  # the stream is flowing
        await server.shutdown(grace_s=0.0)
        async with asyncio.timeout(30):
            rest = await reader.read()  # to the connection's end
        assert rest.endswith(b"0\r\n\r\n")  # the chunked body's end: not cut off
        assert b"data: [DONE]" in rest
        error = rest[rest.rindex(b'{"error"') : rest.rindex(b"}") + 1]
        assert orjson.loads(error)["error"]["code"] == "shutting_down"
        writer.close()
    finally:
        await worker.stop()
