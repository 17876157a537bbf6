"""A small real HTTP worker for router tests: records every request it gets and answers like an
OpenAI server, or fails in the ways the router must survive (5xx, dying mid-stream, hanging).

Not an emulator: it exists to observe exactly what the router sent (bytes and headers) and to
produce failures on demand; the e2e tests use the real emulated engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ownerserve.errors import InvalidRequestError
from ownerserve.kvfetch import FETCH_PATH, KVFetchRequest
from ownerserve.ports import free_port


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class FakeWorker:
    """`mode`: ok | fail500 | die_midstream | hang | slow (0.5 s between stream chunks)."""

    name: str
    mode: str = "ok"
    chunks: int = 4
    fetch_status: int = 200  # what `POST /ownerserve/kv/fetch` answers (non-200: the fetch failed)
    fetch_delay_s: float = 0.0  # how long a fetch takes (`cancelled` is set if given up)
    health_hangs: bool = False  # `GET /health` never answers (a stalled process)
    requests: list[Recorded] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completions(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.startswith("/v1/")]

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post(FETCH_PATH, self._fetch)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self.port = free_port()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _: web.Request) -> web.Response:
        if self.health_hangs:
            await asyncio.Event().wait()
        return web.json_response({})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    async def _fetch(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append(Recorded(request.path, dict(request.headers), raw))
        try:  # the router's body must be one the real workers accept
            KVFetchRequest.from_json(orjson.loads(raw))
        except InvalidRequestError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if self.fetch_delay_s:
            try:
                await asyncio.sleep(self.fetch_delay_s)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.fetch_status != 200:
            return web.json_response(
                {"error": {"message": "source gone"}}, status=self.fetch_status
            )
        return web.json_response({"fetched": 1})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(Recorded(request.path, dict(request.headers), raw))
        if self.mode == "fail500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        body = orjson.loads(raw)
        if body.get("model") == "bad-for-worker":
            return web.json_response({"error": {"message": "worker says no"}}, status=400)
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        chat = request.path.endswith("chat/completions")
        extra: dict[str, Any] = {}
        ktp = body.get("kv_transfer_params")
        if isinstance(ktp, dict) and ktp.get("do_remote_decode"):
            extra["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "remote_engine_id": self.name,
                "remote_block_ids": [1, 2],
            }
        if not body.get("stream"):
            msg = {"role": "assistant", "content": f"hello from {self.name}"}
            choice = {"index": 0, "finish_reason": "stop"}
            choice.update({"message": msg} if chat else {"text": msg["content"]})
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": body.get("model"),
                    "choices": [choice],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                    **extra,
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                delta = {"content": f"t{i} "}
                chunk = {"id": "x", "choices": [{"index": 0, "delta": delta}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if self.mode == "die_midstream" and i == 1:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await asyncio.sleep(0.5 if self.mode == "slow" else 0.01)
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp
