"""The shared HTTP plumbing: the one exception -> OpenAI error mapping, FastAPI's errors in that
shape, reading a body within its limit (and draining a refused one, within bounds), and a
64 MiB body from `urllib` answered 413 under uvicorn, as the workers serve."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ownerserve.errors import (
    ClientDisconnected,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from ownerserve.http import (
    MAX_JSON_DEPTH,
    WORKER_ERROR_MESSAGE,
    error_status_and_body,
    install_error_handlers,
    json_object,
    names_internals,
    public_error_body,
    read_body,
    read_request_body,
    sse_error_event,
)
from tests.big_body import body_of_64_mib, urllib_post

# --- the mapping ---------------------------------------------------------------------------------


def test_our_errors_map_to_their_status_and_the_openai_shape():
    status, body = error_status_and_body(InvalidRequestError("bad n", param="n"))
    assert status == 400
    assert orjson.loads(body) == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
    }
    status, body = error_status_and_body(NotFoundError("no worker 'x'"))
    assert status == 404 and orjson.loads(body)["error"]["code"] == "not_found"


def test_an_unexpected_exception_is_a_500_that_leaks_nothing():
    status, body = error_status_and_body(RuntimeError("password=hunter2"))
    assert status == 500
    err = orjson.loads(body)["error"]
    assert err["type"] == "internal_error" and "hunter2" not in err["message"]


def test_an_sse_error_event_carries_the_error_then_done():
    event = sse_error_event(PayloadTooLargeError("too big"))
    first, done, rest = event.split(b"\n\n")
    assert orjson.loads(first.removeprefix(b"data: "))["error"]["message"] == "too big"
    assert (done, rest) == (b"data: [DONE]", b"")


# --- FastAPI -------------------------------------------------------------------------------------


class _Body(BaseModel):
    n: int


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/ours")
    async def ours() -> None:
        raise NotFoundError("no artifact 'k'")

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("secret internals")

    @app.post("/typed")
    async def typed(body: _Body) -> JSONResponse:
        return JSONResponse({"n": body.n})

    @app.post("/upload")
    async def upload(request: Request) -> JSONResponse:
        data = await read_request_body(request.scope, request.receive, 1 << 20)
        return JSONResponse({"bytes": len(data)})

    return app


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "words"),
    [
        ("GET", "/ours", None, 404, "not_found", "no artifact"),
        ("GET", "/nowhere", None, 404, "not_found", "no such endpoint"),
        ("DELETE", "/ours", None, 405, "method_not_allowed", "not allowed"),
        ("POST", "/typed", {"n": "x"}, 400, None, "invalid request: body.n"),
        ("GET", "/crash", None, 500, None, "internal server error"),
    ],
)
async def test_every_error_a_fastapi_app_answers_is_openai_shaped(
    method: str, path: str, body: Any, status: int, code: str | None, words: str
):
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        resp = await client.request(method, path, json=body)
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and words in err["message"]
    assert "secret" not in err["message"]


# --- reading a body ------------------------------------------------------------------------------


class _Client:
    """An ASGI `receive` for a body sent in `chunks` (then the client waits, or sends forever
    when `endless`), `pause_s` between chunks; counts what the server took."""

    def __init__(self, chunks: list[bytes], *, endless: bool = False, pause_s: float = 0.0) -> None:
        self.chunks = chunks
        self.endless = endless
        self.pause_s = pause_s
        self.taken = 0

    async def __call__(self) -> dict[str, Any]:
        await asyncio.sleep(self.pause_s)
        if self.taken < len(self.chunks) or self.endless:
            chunk = self.chunks[min(self.taken, len(self.chunks) - 1)]
            self.taken += 1
            more = self.endless or self.taken < len(self.chunks)
            return {"type": "http.request", "body": chunk, "more_body": more}
        await asyncio.Event().wait()  # a server's receive blocks once the body is read
        raise AssertionError("unreachable")


async def test_a_body_within_the_limit_is_read_whole():
    assert await read_body(_Client([b"ab", b"", b"cd"]), 4, None) == b"abcd"
    assert await read_body(_Client([b"abcd"]), 4, b"4") == b"abcd"


async def test_a_declared_body_over_the_limit_is_refused_after_draining_it():
    client = _Client([b"x" * 10] * 5)
    with pytest.raises(PayloadTooLargeError, match="of 50 bytes exceeds 20"):
        await read_body(client, 20, "50")
    assert client.taken == 5  # all of it read: the server can close without a reset


async def test_a_client_waiting_for_100_continue_is_refused_before_it_sends():
    client = _Client([b"x" * 10] * 5)
    with pytest.raises(PayloadTooLargeError):
        await read_body(client, 20, "50", expects_continue=True)
    assert client.taken == 0


async def test_a_streamed_body_over_the_limit_is_refused_after_draining_the_rest():
    client = _Client([b"x" * 10] * 5)
    with pytest.raises(PayloadTooLargeError, match="exceeds 20 bytes"):
        await read_body(client, 20, None)
    assert client.taken == 5


async def test_draining_a_refused_body_stops_at_the_byte_bound():
    client = _Client([b"x" * 1000], endless=True)
    with pytest.raises(PayloadTooLargeError):
        await read_body(client, 100, None, drain_bytes=50_000, drain_s=60)
    assert 50 <= client.taken <= 52


async def test_draining_a_refused_body_stops_at_the_time_bound():
    client = _Client([b"x" * 1000], endless=True, pause_s=0.01)
    started = time.monotonic()
    with pytest.raises(PayloadTooLargeError):
        await read_body(client, 100, None, drain_bytes=1 << 40, drain_s=0.3)
    assert 0.25 < time.monotonic() - started < 3


async def test_a_client_gone_mid_body_raises_client_disconnected():
    messages = iter([{"type": "http.request", "body": b"ab", "more_body": True}])

    async def receive() -> dict[str, Any]:
        return next(messages, {"type": "http.disconnect"})

    with pytest.raises(ClientDisconnected):
        await read_body(receive, 100, None)


async def test_an_unreadable_content_length_is_a_400():
    with pytest.raises(InvalidRequestError, match="content-length"):
        await read_body(_Client([b"x"]), 100, "ten")


def _nested_body(depth: int) -> bytes:
    """A JSON object nested `depth` levels deep (the object itself and lists inside)."""
    return b'{"a":' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 254, 255, 1000])
def test_a_body_nested_past_the_depth_limit_is_a_400(depth: int):
    # orjson reads 1024 levels but writes only 254: such a body was read, then its writing
    # again (a message as a cache key, a front door's chat request) raised a 500
    with pytest.raises(InvalidRequestError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        json_object(_nested_body(depth))


def test_a_body_nested_to_the_limit_is_read_and_written_again_a_few_levels_deeper():
    data = json_object(_nested_body(MAX_JSON_DEPTH))
    for _ in range(50):
        data = {"wrapped": data}
    assert orjson.dumps(data)
    assert json_object(b'{"a": "' + b"[" * 5000 + b'"}') == {"a": "[" * 5000}


# --- under uvicorn -------------------------------------------------------------------------------


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def _uvicorn(app: FastAPI) -> AsyncIterator[str]:
    server = _InLoopServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, http="httptools", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_64_mib_body_from_urllib_gets_the_413_under_uvicorn(declared: bool):
    body = body_of_64_mib(declared)
    async with _uvicorn(_app()) as url:
        status, answer = await asyncio.to_thread(urllib_post, url + "/upload", body)
        assert status == 413
        assert orjson.loads(answer)["error"]["code"] == "payload_too_large"
        ok = await asyncio.to_thread(urllib_post, url + "/upload", b"x" * 1000)
        assert ok == (200, b'{"bytes":1000}')


# --- a worker's error, as the client gets it ---------------------------------------------------


def test_a_workers_error_keeps_its_words_and_status_fields():
    body, withheld = public_error_body(
        400, b'{"error": {"message": "worker says no", "type": "BadRequestError", "param": "n"}}'
    )
    assert withheld is None
    assert orjson.loads(body) == {
        "error": {
            "message": "worker says no",
            "type": "BadRequestError",
            "param": "n",
            "code": None,
        }
    }
    # vLLM's flat error shape, and a framework's `detail`
    flat = b'{"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}'
    assert orjson.loads(public_error_body(400, flat)[0])["error"]["message"] == "too long"
    detail = public_error_body(422, b'{"detail": "messages: field required"}')[0]
    assert orjson.loads(detail)["error"]["message"] == "messages: field required"


@pytest.mark.parametrize(
    "message",
    [
        "kv_transfer_params: cannot reach http://127.0.0.1:4242/ownerserve/kv/pull: ReadError('')",
        "bootstrap room 7: cannot reach 10.0.0.3:8998",
        "pull from worker-3.cluster.local:8000 failed",
        "stale kv_transfer_params: engine 'p0-1a2b3c4d' is not this worker's",
        "cannot connect to [fe80::1]:9000",
        "",
    ],
)
def test_a_workers_error_naming_internals_becomes_a_generic_one(message: str):
    raw = orjson.dumps({"error": {"message": message, "type": "invalid_request_error"}})
    body, withheld = public_error_body(400, raw)
    err = orjson.loads(body)["error"]
    assert err == {
        "message": WORKER_ERROR_MESSAGE,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert withheld == raw.decode()  # for the router's log


def test_a_workers_body_that_is_no_error_json_is_never_passed_on():
    body, withheld = public_error_body(502, b"<html>upstream 10.1.2.3:80 down</html>")
    assert orjson.loads(body)["error"] == {
        "message": WORKER_ERROR_MESSAGE,
        "type": "upstream_error",
        "param": None,
        "code": None,
    }
    assert withheld == "<html>upstream 10.1.2.3:80 down</html>"
    assert not names_internals("This model's maximum context length is 4096 tokens.")
