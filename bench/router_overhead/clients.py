"""Which HTTP client the router uses towards workers, chosen on CPU per request: httpx vs
aiohttp vs the router's own `router.upstream.UpstreamPool`, each sending the same 2 KB chat
completion (non-streaming and streaming) over keep-alive connections to the fast backend.
CPU is this process's (the client's) `process_time`, so the backend's work is excluded.

    .venv/bin/python -m bench.router_overhead.clients [--n 3000] [--conc 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import uvloop

from bench.router_overhead.run import REPO, wait_http
from ownerserve.ports import free_port
from router.upstream import UpstreamPool, header_block

BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "x" * 2000}]}
).encode()
STREAM_BODY = BODY[:-1] + b',"stream":true}'


async def _timed(n: int, conc: int, one: Callable[[bytes], Awaitable[int]], body: bytes) -> float:
    async def worker(k: int) -> None:
        for _ in range(k):
            assert await one(body) > 0

    await worker(50)  # warm the connections
    c0 = time.process_time()
    await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
    return (time.process_time() - c0) * 1e6 / (n // conc * conc)


async def run(url: str, n: int, conc: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    path = "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, limits=limits) as hx:

        async def hx_one(body: bytes) -> int:
            if body is STREAM_BODY:
                async with hx.stream("POST", path, content=body, headers=headers) as r:
                    return sum([len(c) async for c in r.aiter_raw()])
            r = await hx.post(path, content=body, headers=headers)
            return len(r.content)

        results["httpx"] = {
            "non-stream": await _timed(n, conc, hx_one, BODY),
            "stream": await _timed(n, conc, hx_one, STREAM_BODY),
        }
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
    ) as ah:

        async def ah_one(body: bytes) -> int:
            async with ah.post(url + path, data=body, headers=headers) as r:
                if body is STREAM_BODY:
                    return sum([len(c) async for c in r.content.iter_any()])
                return len(await r.read())

        results["aiohttp"] = {
            "non-stream": await _timed(n, conc, ah_one, BODY),
            "stream": await _timed(n, conc, ah_one, STREAM_BODY),
        }
    pool = UpstreamPool()
    block = header_block(headers)

    async def up_one(body: bytes) -> int:
        r = await pool.request(url, b"POST", path, block, body)
        size = 0
        while chunk := await r.readany():
            size += len(chunk)
        r.release()
        return size

    results["router.upstream"] = {
        "non-stream": await _timed(n, conc, up_one, BODY),
        "stream": await _timed(n, conc, up_one, STREAM_BODY),
    }
    await pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="requests per client and mode")
    ap.add_argument("--conc", type=int, default=8, help="concurrent requests")
    args = ap.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "bench.router_overhead.backend", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        uvloop.install()
        results = asyncio.run(run(f"http://127.0.0.1:{port}", args.n, args.conc))
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    print("| client | non-stream CPU µs/req | stream CPU µs/req |")
    print("| --- | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['non-stream']:.0f} | {r['stream']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
