"""An OpenAI-compatible backend (vLLM's probes and a chat endpoint) whose chat answers wait
until the test lets them go, counting the requests it holds at once: the e2e check that a
bound on in-flight requests per worker holds over several router processes.

    python -m tests.e2e.gated_backend --port P --model M
    POST /release   lets one held (or the next) chat request answer
    GET /stats      {"current", "peak", "served"}
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse


def gated_app(model: str) -> FastAPI:
    app = FastAPI()
    gate = asyncio.Semaphore(0)
    counts = {"current": 0, "peak": 0, "served": 0}

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            "vllm:kv_cache_usage_perc 0\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000000"} 1.0\n'
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    @app.post("/release")
    async def release() -> JSONResponse:
        gate.release()
        return JSONResponse(counts)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(counts)

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        counts["current"] += 1
        counts["peak"] = max(counts["peak"], counts["current"])
        try:
            await gate.acquire()
        finally:
            counts["current"] -= 1
        counts["served"] += 1
        body: dict[str, Any] = {
            "id": "chatcmpl-gated",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        }
        return JSONResponse(body)

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    uvicorn.run(gated_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
