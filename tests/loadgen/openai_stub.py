"""A tiny OpenAI-compatible streaming server for the client's tests (a real HTTP server on a
loopback port): it streams `max_tokens` one-character chunks, reports usage, and fails on cue so
the error paths can be reached for real — content containing `FAIL500` gets an HTTP 500,
`FAILSTREAM` an error event after the first token, `SLOW` a 5 s pause before the first token."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def create_stub_app(token_delay_s: float = 0.001) -> FastAPI:
    app = FastAPI()
    app.state.bodies = []
    app.state.headers = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.bodies.append(body)
        app.state.headers.append(dict(request.headers))
        text = "".join(str(m.get("content", "")) for m in body["messages"])
        n = int(body.get("max_tokens", 16))
        usage = {"prompt_tokens": len(text), "completion_tokens": n, "total_tokens": len(text) + n}
        if "FAIL500" in text:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)

        async def events() -> AsyncIterator[str]:
            if "SLOW" in text:
                await asyncio.sleep(5.0)
            for i in range(n):
                if i == 1 and "FAILSTREAM" in text:
                    yield "data: " + json.dumps({"error": {"message": "worker died"}}) + "\n\n"
                    return
                chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
                yield "data: " + json.dumps(chunk) + "\n\n"
                await asyncio.sleep(token_delay_s)
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.asynccontextmanager
async def serve_stub(app: FastAPI) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
