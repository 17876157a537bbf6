"""A request given up while the executor waits on a worker, over real HTTP: its client leaving
or its `request_timeout_s` running out between a worker's response headers and its first body
bytes (a stream still prefilling), and in an SGLang hand-over (P and D at once, two tasks).
Every time the connection to each worker involved is closed (the worker sees its handler
cancelled: it would abort the generation), the request's tasks end, and a timeout answers
504, not a hang. Plans are fixed (`FixedPolicy`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from planner.types import Action
from tests.router.fake_worker import FakeWorker
from tests.router.test_app import CHAT, FixedPolicy, router_for
from tests.router.waiting import until

pytestmark = pytest.mark.timeout(30)  # a connection left open hangs the workers' shutdown

STREAM = {**CHAT, "stream": True}


@dataclass
class Stalling(FakeWorker):
    """A `FakeWorker` whose answer to each completion request `behave(body)` picks: `headers`
    (the SSE headers, then nothing: a prefill under way), `silent` (nothing at all), `fail500`
    (once `go` is set), or `ok` (a short stream). `open` counts the handlers stalled now,
    `closed` those the router's connection close cancelled."""

    behave: Callable[[dict[str, Any]], str] = field(default=lambda _: "ok")
    go: asyncio.Event = field(default_factory=asyncio.Event)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    open: int = 0
    closed: int = 0

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        how = self.behave(body)
        if how == "fail500":
            await self.go.wait()
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        if how == "ok":
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "delta": {"content": self.name}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
            return resp
        self.open += 1
        try:
            if how == "headers":
                await resp.prepare(request)
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.closed += 1
            raise
        finally:
            self.open -= 1
        return resp


@contextlib.asynccontextmanager
async def stalling(
    *behaviours: Callable[[dict[str, Any]], str],
) -> AsyncIterator[list[Stalling]]:
    ws = [Stalling(f"w{i}", behave=b) for i, b in enumerate(behaviours)]
    for w in ws:
        await w.start()
    try:
        yield ws
    finally:
        for w in ws:
            await w.stop()


def always(how: str) -> Callable[[dict[str, Any]], str]:
    return lambda _: how


def in_the_room(room: str, otherwise: str) -> Callable[[dict[str, Any]], str]:
    """`room` for a request of an SGLang hand-over (it carries a bootstrap room), else
    `otherwise` (the colocated run after a hand-over given up)."""
    return lambda body: room if "bootstrap_room" in body else otherwise


class Tasks:
    """The router's tasks started after this was made (the workers' aiohttp server runs in
    this event loop too: a connection it keeps alive keeps a task of its own)."""

    def __init__(self) -> None:
        self.before = asyncio.all_tasks()

    def new(self) -> set[asyncio.Task[Any]]:
        me = asyncio.current_task()
        return {
            t
            for t in asyncio.all_tasks() - self.before
            if t is not me and "/aiohttp/" not in _source(t)
        }


def _source(task: asyncio.Task[Any]) -> str:
    code = getattr(task.get_coro(), "cr_code", None)
    return "" if code is None else code.co_filename


async def leave_when(client: httpx.AsyncClient, started: Callable[[], bool]) -> None:
    """Stream `STREAM`; once `started()`, walk away before any answer came."""
    call = asyncio.create_task(client.post("/v1/chat/completions", json=STREAM))
    await until(lambda: started() or call.done())
    assert not call.done(), call.result().text
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_client_leaving_before_the_first_token_closes_the_upstream() -> None:
    async with stalling(always("headers")) as (w0,):
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        async with router_for([(w0, "hybrid", "emulator")], policy) as (c, router):
            tasks = Tasks()
            # the worker sent its headers: the router waits for the first body bytes
            await leave_when(c, lambda: w0.open == 1)
            await until(lambda: w0.closed == 1)
            await until(lambda: not tasks.new())
            assert router.pool.get("w0").inflight == 0 and w0.open == 0


async def test_a_request_timeout_before_the_first_token_answers_504_and_closes_the_upstream() -> (
    None
):
    async with stalling(always("headers")) as (w0,):
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        server = {"request_timeout_s": 0.5, "first_byte_timeout_s": 600}
        async with router_for([(w0, "hybrid", "emulator")], policy, server) as (c, router):
            tasks = Tasks()
            resp = await c.post("/v1/chat/completions", json=STREAM)
            assert resp.status_code == 504
            assert resp.json()["error"]["message"] == "request timed out"
            await until(lambda: w0.closed == 1)
            await until(lambda: not tasks.new())
            assert router.pool.get("w0").inflight == 0 and w0.open == 0


SGLANG = [("prefill", "sglang"), ("decode", "sglang")]


@pytest.mark.parametrize("decode", ["headers", "silent"])
async def test_a_client_leaving_an_sglang_hand_over_closes_both_sides(decode: str) -> None:
    async with stalling(always("silent"), always(decode)) as (p, d):
        policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
        workers: list[tuple[FakeWorker, str, str]] = [
            (w, role, kind) for w, (role, kind) in zip((p, d), SGLANG, strict=True)
        ]
        async with router_for(workers, policy) as (c, router):
            tasks = Tasks()
            await leave_when(c, lambda: p.open == 1 and d.open == 1)
            await until(lambda: p.closed == 1 and d.closed == 1)
            await until(lambda: not tasks.new())
            assert router.pool.get("w0").inflight == 0 and router.pool.get("w1").inflight == 0


async def test_a_request_timeout_in_an_sglang_hand_over_answers_504_and_closes_both_sides() -> None:
    async with stalling(always("silent"), always("headers")) as (p, d):
        policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
        workers: list[tuple[FakeWorker, str, str]] = [
            (w, role, kind) for w, (role, kind) in zip((p, d), SGLANG, strict=True)
        ]
        server = {"request_timeout_s": 0.5, "first_byte_timeout_s": 600}
        server["kv_transfer_timeout_s"] = 600
        async with router_for(workers, policy, server) as (c, _):
            tasks = Tasks()
            resp = await c.post("/v1/chat/completions", json=STREAM)
            assert resp.status_code == 504
            await until(lambda: p.closed == 1 and d.closed == 1)
            await until(lambda: not tasks.new())


async def test_a_failed_sglang_prefill_closes_the_waiting_decode_and_runs_colocated() -> None:
    async with stalling(always("fail500"), in_the_room("headers", "ok")) as (p, d):
        policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
        workers: list[tuple[FakeWorker, str, str]] = [
            (w, role, kind) for w, (role, kind) in zip((p, d), SGLANG, strict=True)
        ]
        async with router_for(workers, policy) as (c, _):
            tasks = Tasks()
            call = asyncio.create_task(c.post("/v1/chat/completions", json=STREAM))
            await until(lambda: d.open == 1)  # D waits at the room: now P fails
            p.go.set()
            resp = await call
            assert resp.status_code == 200 and "w1" in resp.text
            assert "fallback=colocated" in resp.headers["x-ownerserve-plan"]
            # D's side of the room was given up: its connection closed
            await until(lambda: d.closed == 1)
            assert ["bootstrap_room" in b for b in d.bodies] == [True, False]
            await until(lambda: not tasks.new())
