"""Closed-loop HTTP/1.1 load with keep-alive connections, cheap enough per request (raw asyncio
protocol + httptools on uvloop) not to be the bottleneck on a 2-core box.

Each connection sends chat completions with distinct ~2 KB prompts back to back and records
latency (request write → last byte) and time to first byte. Prints one JSON line.

    python -m bench.router_overhead.load --targets 127.0.0.1:8000 -c 16 --secs 8 [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httptools
import uvloop

WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
]  # fmt: skip


def _text(rnd: random.Random, head: str, size: int) -> str:
    words = [head]
    n = len(head)
    while n < size:
        w = rnd.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


def bodies(
    model: str, conn: int, n: int, stream: bool, host: str, session_turns: int = 0
) -> list[bytes]:
    """`n` requests. Without sessions: each a new ~2 KB prompt. With `session_turns` T:
    sessions of T turns, each turn the previous messages plus a short tool result (~200 B)
    and the next user step, with an `x-session-id` header (an agent loop)."""
    rnd = random.Random(conn * 7919 + 1)
    out = []
    messages: list[dict[str, str]] = []
    for i in range(n):
        extra = b""
        if session_turns:
            session, turn = divmod(i, session_turns)
            if turn == 0:
                system = _text(rnd, f"session-{conn}-{session}-{rnd.randrange(10**9)}:", 2000)
                messages = [{"role": "system", "content": system}]
            else:
                messages.append({"role": "assistant", "content": "calling a tool"})
                messages.append({"role": "tool", "content": _text(rnd, f"result {turn}:", 200)})
            messages.append({"role": "user", "content": f"step {turn}: continue"})
            msgs: list[dict[str, str]] = list(messages)
            extra = b"x-session-id: s-%d-%d\r\n" % (conn, session)
        else:
            head = f"session-{conn}-{i}-{rnd.randrange(10**9)}:"
            msgs = [{"role": "user", "content": _text(rnd, head, 2000)}]
        body = json.dumps(
            {"model": model, "messages": msgs, "max_tokens": 16, "stream": stream}
        ).encode()
        out.append(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json"
            b"\r\n%scontent-length: %d\r\n\r\n%s" % (host.encode(), extra, len(body), body)
        )
    return out


class Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None
        self.first = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))


async def connection(
    conn: int, host: str, port: int, args: argparse.Namespace, start: float, stop: float,
    stats: dict[str, Any],
) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    reqs = bodies(
        args.model, conn, args.nprompts, args.stream, f"{host}:{port}", args.session_turns
    )
    transport, proto = await loop.create_connection(Client, host, port)
    i = 0
    while True:
        now = time.perf_counter()
        if now >= stop:
            break
        proto.waiter = loop.create_future()
        proto.first = 0.0
        t0 = time.perf_counter()
        transport.write(reqs[i % len(reqs)])
        i += 1
        try:
            status = await proto.waiter
        except ConnectionError:
            stats["errors"] += 1
            transport, proto = await loop.create_connection(Client, host, port)
            continue
        t1 = time.perf_counter()
        if t0 < start:
            continue
        if status != 200:
            stats["non200"] += 1
        stats["lat"].append(t1 - t0)
        stats["ttfb"].append(proto.first - t0)
    transport.close()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = [(h, int(p)) for h, _, p in (t.rpartition(":") for t in args.targets.split(","))]
    stats: dict[str, Any] = {"lat": [], "ttfb": [], "errors": 0, "non200": 0}
    t = time.perf_counter()
    start, stop = t + args.warmup, t + args.warmup + args.secs
    await asyncio.gather(
        *(
            connection(c, *targets[c % len(targets)], args, start, stop, stats)
            for c in range(args.c)
        )
    )
    lat, ttfb = stats["lat"], stats["ttfb"]
    return {
        "requests": len(lat),
        "secs": args.secs,
        "rps": len(lat) / args.secs,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p90_ms": pct(lat, 0.9) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "ttfb_p50_ms": pct(ttfb, 0.5) * 1e3,
        "errors": stats["errors"],
        "non200": stats["non200"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", required=True, help="host:port[,host:port] (connections RR)")
    ap.add_argument("-c", type=int, default=16, help="connections")
    ap.add_argument("--secs", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--model", default="bench-model")
    ap.add_argument("--nprompts", type=int, default=256, help="distinct prompts per connection")
    ap.add_argument(
        "--session-turns", type=int, default=0, help="agent sessions of this many turns"
    )
    args = ap.parse_args(argv)
    uvloop.install()
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
