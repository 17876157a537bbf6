"""A near-zero-cost OpenAI-compatible backend for measuring router overhead.

Raw asyncio protocol on uvloop + httptools, HTTP/1.1 keep-alive, canned answers: the chat and
completion endpoints (SSE when `"stream": true`), and the probes each router calls on its
workers (`/health`, `/metrics`, `/v1/models`; SGLang's `/server_info`, `/model_info`,
`/get_load`). `GET /stats` counts served completions.

    python -m bench.router_overhead.backend --port 18001 [--model bench-model] [--chunks 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httptools
import uvloop


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"OK")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        reason,
        ctype,
        len(body),
    )
    return head + body


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Canned:
    """Every answer, rendered once."""

    def __init__(self, model: str, name: str, chunks: int) -> None:
        def dumps(obj: Any) -> bytes:
            return json.dumps(obj, separators=(",", ":")).encode()

        usage = {"prompt_tokens": 500, "completion_tokens": chunks, "total_tokens": 500 + chunks}
        text = f"Hello from {name}!"
        self.chat = _response(
            200,
            dumps(
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            ),
        )
        self.completion = _response(
            200,
            dumps(
                {
                    "id": "cmpl-bench",
                    "object": "text_completion",
                    "created": 0,
                    "model": model,
                    "choices": [
                        {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                    ],
                    "usage": usage,
                }
            ),
        )
        words = ["Hello", " from", f" {name}", "!", " more", " tokens", " here", "."]
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chat_events, compl_events = [], []
        for i in range(chunks):
            w = words[i % len(words)]
            delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
            chat_events.append(
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                }
            )
            compl_events.append(
                {
                    "id": "cmpl-bench",
                    "object": "text_completion",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "text": w, "finish_reason": None}],
                }
            )
        chat_events.append(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        )
        compl_events.append(
            {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
            }
        )

        def sse(events: list[dict[str, Any]]) -> list[bytes]:
            # one write per event, as an engine streams tokens
            parts = [_chunked(b"data: " + dumps(e) + b"\n\n") for e in events]
            parts.append(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            parts[0] = head + parts[0]
            return parts

        self.chat_stream = sse(chat_events)
        self.completion_stream = sse(compl_events)
        self.health = _response(200, b"{}")
        self.metrics = _response(
            200,
            b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            b"vllm:kv_cache_usage_perc 0\n"
            # a pool no benchmark fills (1M blocks of 16): the router's admission never holds
            # a request, so the bench measures the router's own work
            b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000000"} 1.0\n',
            b"text/plain",
        )
        self.models = _response(
            200,
            dumps(
                {
                    "object": "list",
                    "data": [{"id": model, "object": "model", "created": 0, "owned_by": "bench"}],
                }
            ),
        )
        # No model_path: sglang-router would try to download a tokenizer for it.
        self.model_info = _response(200, dumps({"is_generation": True, "served_model_name": model}))
        self.server_info = _response(
            200,
            dumps(
                {
                    "served_model_name": model,
                    "disaggregation_mode": "null",
                    "dp_size": 1,
                    "tp_size": 1,
                    "max_total_num_tokens": 100000,
                    "internal_states": [{}],
                }
            ),
        )
        self.load = _response(200, b'{"load": 0}')
        self.not_found = _response(404, b'{"error":"not found"}')


class BackendProtocol(asyncio.Protocol):
    canned: Canned
    served = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        c = self.canned
        path = self.url.split(b"?", 1)[0]
        method = self.parser.get_method()
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            body = b"".join(self.body)
            stream = b'"stream":true' in body or b'"stream": true' in body
            chat = path == b"/v1/chat/completions"
            BackendProtocol.served += 1
            if stream:
                self._write_events(list(c.chat_stream if chat else c.completion_stream))
                return
            out = c.chat if chat else c.completion
        elif path in (b"/health", b"/health_generate", b"/ping"):
            out = c.health
        elif path == b"/metrics":
            out = c.metrics
        elif path == b"/v1/models":
            out = c.models
        elif path in (b"/model_info", b"/get_model_info"):
            out = c.model_info
        elif path in (b"/server_info", b"/get_server_info"):
            out = c.server_info
        elif path == b"/get_load":
            out = c.load
        elif path == b"/stats":
            out = _response(200, json.dumps({"served": BackendProtocol.served}).encode())
        else:
            out = c.not_found
        self.transport.write(out)
        if not self.parser.should_keep_alive():
            self.transport.close()

    def _write_events(self, parts: list[bytes]) -> None:
        """Write the SSE events one loop iteration apart (separate TCP segments)."""
        keep_alive = self.parser.should_keep_alive()
        loop = asyncio.get_running_loop()

        def step(i: int) -> None:
            if self.transport.is_closing():
                return
            self.transport.write(parts[i])
            if i + 1 < len(parts):
                loop.call_soon(step, i + 1)
            elif not keep_alive:
                self.transport.close()

        step(0)


async def _serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(BackendProtocol, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="bench-model")
    ap.add_argument("--chunks", type=int, default=4, help="content chunks per SSE answer")
    args = ap.parse_args(argv)
    BackendProtocol.canned = Canned(args.model, f"backend-{args.port}", args.chunks)
    uvloop.install()
    asyncio.run(_serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
