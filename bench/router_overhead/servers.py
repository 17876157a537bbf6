"""Which HTTP server carries the router's data path, chosen on CPU per request: uvicorn
(httptools, uvloop) running an ASGI app vs a raw asyncio protocol with httptools (what
`router.httpserver` is built on), each once answering a canned response and once proxying
to the fast backend through `router.upstream`. The load is `bench.router_overhead.load`
(closed loop, keep-alive, ~2 KB chat bodies); CPU is the server process's `process_time`
over the measured window, so load generator and backend are excluded.

    .venv/bin/python -m bench.router_overhead.servers [--secs 4] [-c 1,16]

Each variant runs in a fresh process (`--variant NAME --backend PORT` is the child mode).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from typing import Any

import httptools
import uvloop

from bench.router_overhead.run import REPO, started, wait_http
from ownerserve.ports import free_port

VARIANTS = ("uvicorn canned", "raw canned", "uvicorn proxy", "raw proxy")
CANNED = b'{"id":"x","object":"chat.completion","choices":[{"message":{"content":"hi"}}]}'
_HEADERS = b"content-type: application/json\r\n"


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def _child(variant: str, backend: int, conns: int, secs: float) -> dict[str, Any]:
    from router.upstream import UpstreamPool

    pool = UpstreamPool()
    upstream = f"http://127.0.0.1:{backend}"
    proxy = variant.endswith("proxy")

    async def forward(body: bytes) -> bytes:
        resp = await pool.request(upstream, b"POST", "/v1/chat/completions", _HEADERS, body)
        data = await resp.read()
        resp.release()
        return data

    port = free_port()
    if variant.startswith("uvicorn"):
        import uvicorn

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            parts = []
            while True:
                message = await receive()
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            data = await forward(b"".join(parts)) if proxy else CANNED
            headers = [(b"content-type", b"application/json")]
            headers.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, loop="none", http="httptools",
            log_level="warning", access_log=False, lifespan="off",
        )  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
    else:

        class Raw(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)
                self.body: list[bytes] = []

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_body(self, body: bytes) -> None:
                self.body.append(body)

            def on_message_complete(self) -> None:
                body = b"".join(self.body)
                self.body = []
                if proxy:
                    self.task = asyncio.ensure_future(self.proxy(body))
                else:
                    self.transport.write(_answer(CANNED))

            async def proxy(self, body: bytes) -> None:
                self.transport.write(_answer(await forward(body)))

        await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
        task = None
    load = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.router_overhead.load", "--targets", f"127.0.0.1:{port}",
        "-c", str(conns), "--secs", str(secs), "--warmup", "1", cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(1.0)  # the load's warm-up
    c0 = time.process_time()
    out, _ = await load.communicate()
    cpu = time.process_time() - c0
    res = json.loads(out.decode().strip().splitlines()[-1])
    if task is not None:
        task.cancel()
    await pool.close()
    return {"cpu_us_per_req": round(cpu * 1e6 / max(1, res["requests"]), 1), "rps": res["rps"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=4.0)
    ap.add_argument("-c", default="1,16", help="connection counts")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--backend", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:
        result = uvloop.run(_child(args.variant, args.backend, args.conns, args.secs))
        print(json.dumps(result), flush=True)
        return 0
    backend = free_port()
    rows = []
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(
            started([sys.executable, "-m", "bench.router_overhead.backend", "--port", str(backend)])
        )
        wait_http(f"http://127.0.0.1:{backend}/health", proc=proc)
        for conns in (int(c) for c in args.c.split(",")):
            for variant in VARIANTS:
                cmd = [sys.executable, "-m", "bench.router_overhead.servers", "--variant",
                       variant, "--backend", str(backend), "--conns", str(conns),
                       "--secs", str(args.secs)]  # fmt: skip
                out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append((variant, conns, r["cpu_us_per_req"], r["rps"]))
    print("| server | connections | server CPU µs/req | req/s |")
    print("| --- | ---: | ---: | ---: |")
    for variant, conns, cpu, rps in rows:
        print(f"| {variant} | {conns} | {cpu} | {rps:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
