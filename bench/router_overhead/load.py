"""Closed-loop HTTP/1.1 load with keep-alive connections, cheap enough per request (raw asyncio
protocol + httptools on uvloop) not to be the bottleneck on a 2-core box.

Each connection sends chat completions with distinct ~2 KB prompts back to back and records
latency (request write → last byte) and time to first byte. Prints one JSON line.
`--grow-to CHARS` sends long agent sessions instead (`AgentSession`): each turn resends the
whole conversation plus one tool call and its output, until the prompt reaches CHARS.

    python -m bench.router_overhead.load --targets 127.0.0.1:8000 -c 16 --secs 8 [--stream]
        [--grow-to 32768 --turns 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Iterator
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


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the workspace and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string", "description": "the command"}},
                "required": ["cmd"],
            },
        },
    }
]


class AgentSession:
    """Requests of agent sessions whose prompt grows to `grow_to` characters in `turns` turns:
    a system prompt (~2 KB) and a task, then each turn the assistant's tool call (an id,
    `run_command` and its arguments), the tool's output (`tool_call_id` naming that call) and
    the user's next step, the whole conversation resent each turn. Every `tool` message
    answers an assistant tool call, so every router accepts it. A session ends after `turns`
    turns and the next one starts with a new system prompt and session id.

    The body is built from the messages' JSON encoded once each (as an agent's client would
    resend them), so the generator's cost stays small beside the router's."""

    def __init__(self, model: str, conn: int, stream: bool, host: str, grow_to: int, turns: int):
        self.model = model
        self.conn = conn
        self.stream = stream
        self.host = host.encode()
        self.turns = max(1, turns)
        self.step = max(64, (grow_to - 2200) // max(1, self.turns - 1))
        """Characters one turn adds (tool call, tool output, next step)."""
        self.rnd = random.Random(conn * 7919 + 3)

    def _dumps(self, obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def requests(self) -> Iterator[bytes]:
        tail = self._dumps(
            {"tools": TOOLS, "max_tokens": 16, "stream": self.stream}
        )  # joined as the body's last fields
        head = b'{"model":%s,"messages":[' % self._dumps(self.model)
        rnd = self.rnd
        session = 0
        while True:
            sid = f"s-{self.conn}-{session}-{rnd.randrange(10**9)}"
            system = _text(rnd, f"session {sid}: you are a coding agent.", 2000)
            msgs = [
                self._dumps({"role": "system", "content": system}),
                self._dumps({"role": "user", "content": "fix the failing test in the repo"}),
            ]
            extra = b"x-session-id: %s\r\n" % sid.encode()
            for turn in range(self.turns):
                if turn:
                    call = f"call_{session}_{turn}"
                    cmd = _text(rnd, f"grep -rn step{turn}", 60)
                    args = json.dumps({"cmd": cmd})
                    msgs.append(self._dumps({
                        "role": "assistant", "content": None,
                        "tool_calls": [{"id": call, "type": "function",
                                        "function": {"name": "run_command", "arguments": args}}],
                    }))  # fmt: skip
                    output = _text(rnd, f"output of {call}:", self.step - 200)
                    msgs.append(
                        self._dumps({"role": "tool", "tool_call_id": call, "content": output})
                    )
                    msgs.append(self._dumps({"role": "user", "content": f"step {turn}: go on"}))
                body = head + b",".join(msgs) + b"]," + tail[1:]
                yield (
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\n"
                    b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
                    % (self.host, extra, len(body), body)
                )
            session += 1


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
    if args.grow_to:
        agent = AgentSession(
            args.model, conn, args.stream, f"{host}:{port}", args.grow_to, args.turns
        ).requests()
        next_request = agent.__next__
    else:
        reqs = bodies(
            args.model, conn, args.nprompts, args.stream, f"{host}:{port}", args.session_turns
        )
        cycle = iter(range(1 << 62))

        def next_request() -> bytes:
            return reqs[next(cycle) % len(reqs)]

    transport, proto = await loop.create_connection(Client, host, port)
    while True:
        now = time.perf_counter()
        if now >= stop:
            break
        proto.waiter = loop.create_future()
        proto.first = 0.0
        request = next_request()
        t0 = time.perf_counter()
        transport.write(request)
        try:
            status = await proto.waiter
        except ConnectionError:
            stats["errors"] += 1
            transport, proto = await loop.create_connection(Client, host, port)
            continue
        t1 = time.perf_counter()
        if t0 < start:
            continue
        stats["bytes"] += len(request)
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
    stats: dict[str, Any] = {"lat": [], "ttfb": [], "errors": 0, "non200": 0, "bytes": 0}
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
        "mean_request_bytes": round(stats["bytes"] / max(1, len(lat))),
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
    ap.add_argument(
        "--grow-to", type=int, default=0,
        help="long agent sessions whose prompt grows to this many characters",
    )  # fmt: skip
    ap.add_argument("--turns", type=int, default=16, help="turns of a --grow-to session")
    args = ap.parse_args(argv)
    uvloop.install()
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
