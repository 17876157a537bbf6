"""`ownerserve demo`: the embedded default deployment, end to end on one machine.

Starts three emulated engines (1 prefill, 1 decode, 1 hybrid) as real processes (through
`loadgen.cluster`), the proxy with the in-process ownership directory on 127.0.0.1:8000, sends a
short multi-turn agentic session through the proxy's OpenAI endpoint, prints what the planner
chose for each turn, and keeps serving until Ctrl-C or SIGTERM (or exits after the report with
`--once`). Either stops it as it stops `ownerserve serve`: no new connections, requests in
flight (streams included) get `router.server.SHUTDOWN_GRACE_S` to finish, then the engines
stop and it exits 0; a second signal stops it at once. The engines die with it even when it
is SIGKILLed (`loadgen.cluster`'s lifeline).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadgen.cluster import MODEL, EmulatedWorker, emulated_workers, sigterm_as_interrupt
from ownerserve.config import Settings, settings_from_dict
from ownerserve.errors import ConfigError
from ownerserve.ports import check_bindable
from ownerserve.tasks import cancel_and_wait

ROLES = (("p0", "prefill"), ("d0", "decode"), ("h0", "hybrid"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="exit after the report")
    parser.add_argument("--host", default="127.0.0.1", help="proxy bind address")
    parser.add_argument("--port", type=int, default=8000, help="proxy port (0: pick a free one)")
    parser.add_argument("--policy", default="ownerserve", help="routing policy of the proxy")
    parser.add_argument(
        "--profile", default="h100-llama3-8b", help="timing profile of the emulated workers"
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="emulated time runs this many times faster"
    )
    parser.add_argument("--turns", type=int, default=6, help="agent turns in the demo session")


def demo_workers(profile: str, speed: float) -> list[EmulatedWorker]:
    """The demo's three emulated engines (not started)."""
    return [EmulatedWorker(wid, role, profile=profile, speed=speed) for wid, role in ROLES]


def demo_settings(workers: Sequence[EmulatedWorker], host: str, port: int, policy: str) -> Settings:
    return settings_from_dict(
        {
            "server": {"host": host, "port": port},
            "planner": {"policy": policy},
            "models": [{"name": MODEL}],
            "workers": [w.worker_settings() for w in workers],
        },
        source="<demo>",
    )


REPO_CONTEXT = "".join(
    f"# file src/module_{i}.py\ndef handler_{i}(request):\n"
    f"    return route(request, shard={i}, retries=3)\n\n"
    for i in range(60)
)
SYSTEM = "You are a coding agent. Use the tools to inspect and edit the repository.\n"
TOOL_OUTPUTS = (
    "PASSED tests/test_router.py::test_health\n" * 3,
    "Traceback (most recent call last):\n  File 'src/module_7.py', line 3\n" * 40,
    "diff --git a/src/module_7.py b/src/module_7.py\n+    return route(request)\n" * 4,
    "ok\n",
)


@dataclass(frozen=True, slots=True)
class TurnResult:
    turn: int
    request_class: str
    action: str
    workers: str
    runner_up: str
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


async def _stream_turn(
    client: httpx.AsyncClient, messages: list[dict[str, Any]]
) -> tuple[str, dict[str, str], float, float, dict[str, Any]]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = 0.0
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-session-id": "demo-session"}
    ) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"proxy answered {resp.status_code}: {detail}")
        from planner.explain import parse_plan_header

        plan = parse_plan_header(resp.headers.get("x-ownerserve-plan", ""))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if not ttft:
                        ttft = time.perf_counter() - t0
                    text.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(text), plan, ttft, time.perf_counter() - t0, usage


async def run_session(base_url: str, turns: int) -> list[TurnResult]:
    """One agent session: repository context, then turns that append tool outputs."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Repository:\n" + REPO_CONTEXT + "\nFix the failing test."},
    ]
    results: list[TurnResult] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        for turn in range(1, turns + 1):
            text, plan, ttft, e2e, usage = await _stream_turn(client, messages)
            details = usage.get("prompt_tokens_details") or {}
            results.append(
                TurnResult(
                    turn=turn,
                    request_class=plan.get("class", "?"),
                    action=plan.get("action", "?"),
                    workers=f"P={plan.get('p', '?')} D={plan.get('d', '?')}",
                    runner_up=plan.get("runner_up", "-").split(":")[0],
                    ttft_s=ttft,
                    e2e_s=e2e,
                    prompt_tokens=int(usage.get("prompt_tokens", 0)),
                    completion_tokens=int(usage.get("completion_tokens", 0)),
                    cached_tokens=int(details.get("cached_tokens") or 0),
                )
            )
            messages.append({"role": "assistant", "content": text})
            messages.append(
                {"role": "tool", "content": TOOL_OUTPUTS[(turn - 1) % len(TOOL_OUTPUTS)]}
            )
    return results


def format_report(results: list[TurnResult]) -> str:
    head = (
        f"{'turn':>4}  {'request class':<22} {'action':<20} {'workers':<12} {'TTFT ms':>8} "
        f"{'E2E ms':>7} {'prompt':>6} {'cached':>6} {'out':>4}  runner-up"
    )
    lines = ["", "OwnerServe demo: one agent session through the proxy", head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.turn:>4}  {r.request_class:<22} {r.action:<20} {r.workers:<12} "
            f"{r.ttft_s * 1e3:>8.1f} {r.e2e_s * 1e3:>7.1f} {r.prompt_tokens:>6} "
            f"{r.cached_tokens:>6} {r.completion_tokens:>4}  {r.runner_up}"
        )
    return "\n".join(lines)


async def _main(args: argparse.Namespace, workers: Sequence[EmulatedWorker]) -> int:
    from router.server import SHUTDOWN_GRACE_S, running, stop_on_signals

    settings = demo_settings(workers, args.host, args.port, args.policy)
    stop = asyncio.Event()
    async with running(settings) as base_url:
        # the signals only set `stop`; leaving `running` drains as `ownerserve serve` does
        with stop_on_signals(stop):
            if not await _session_unless_stopped(base_url, args.turns, stop) and not args.once:
                serving = f"Serving the OpenAI API at {base_url}/v1 (model {MODEL!r})"
                print(f"\n{serving}; Ctrl-C to stop.", flush=True)
                await stop.wait()
        if stop.is_set():
            print(
                f"Stopping: requests in flight get up to {SHUTDOWN_GRACE_S:g} s to finish.",
                flush=True,
            )
    return 0


async def _session_unless_stopped(base_url: str, turns: int, stop: asyncio.Event) -> bool:
    """Run the demo's session and print its report; True when `stop` came first (the session,
    the demo's own client, is then dropped)."""
    session = asyncio.create_task(run_session(base_url, turns))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({session, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not session.done():
            await cancel_and_wait(session)
    if not session.done() or session.cancelled():
        return True
    print(format_report(session.result()), flush=True)
    return False


def run(args: argparse.Namespace) -> int:
    if args.port:
        try:
            check_bindable(args.host, args.port)
        except OSError as exc:
            raise ConfigError(
                f"--port {args.port}: cannot bind {args.host}:{args.port} ({exc.strerror})"
            ) from None
    workers = demo_workers(args.profile, args.speed)
    try:
        # SIGTERM (`kill`, a service manager) while the workers start, or a second one while
        # the proxy drains, stops the workers at once as Ctrl-C does
        with sigterm_as_interrupt(), emulated_workers(*workers):
            return asyncio.run(_main(args, workers))
    except KeyboardInterrupt:
        return 0
