"""`ownerserve demo`: the embedded default deployment, end to end on one machine.

Starts four emulated engines (1 prefill, 1 decode, 2 hybrid) as real processes (through
`loadgen.cluster`), the proxy with the in-process ownership directory on 127.0.0.1:8000, and
runs a script of what the planner is for through the proxy's OpenAI endpoint: a long new
prefix, small increments, a long tool output, a subagent forked from its parent's prefix, a
second session competing for the same workers (`SCRIPT`). It prints what the planner chose for
each request, then replays the script under round robin and a sticky router (vllm-router's
consistent hash on the session), each run on cold caches, and prints the KV economics of the
three side by side: prefill computed, reuse held and delivered, KV moved, duplicate factor.
Then it keeps serving until Ctrl-C or SIGTERM (or exits after the report with `--once`).
Either stops it as it stops `ownerserve serve`: no new connections, requests in flight
(streams included) get `router.server.SHUTDOWN_GRACE_S` to finish, then the engines stop and it
exits 0; a second signal stops it at once. The engines die with it even when it is SIGKILLed
(`loadgen.cluster`'s lifeline).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadgen.cluster import MODEL, EmulatedWorker, emulated_workers, sigterm_as_interrupt
from loadgen.metrics import cluster_stats, parse_prometheus, snapshot_all
from loadgen.report import ClusterStats
from ownerserve.config import Settings, settings_from_dict
from ownerserve.errors import ConfigError
from ownerserve.ports import check_bindable
from ownerserve.tasks import cancel_and_wait

ROLES = (("p0", "prefill"), ("d0", "decode"), ("h0", "hybrid"), ("h1", "hybrid"))


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
    parser.add_argument(
        "--admin-token",
        default=None,
        help="serve the admin API (`ownerserve status`) under this token (default: "
        "$OWNERSERVE_SERVER__ADMIN_TOKEN, as `serve` reads it; none: off)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export spans and metrics over OTLP to this collector (telemetry.otlp_endpoint)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=len(SCRIPT),
        help=f"run the first N of the script's {len(SCRIPT)} requests (default: all)",
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="skip replaying the script under round robin and a sticky router",
    )


def demo_workers(profile: str, speed: float) -> list[EmulatedWorker]:
    """The demo's emulated engines, one per `ROLES` entry (not started)."""
    return [EmulatedWorker(wid, role, profile=profile, speed=speed) for wid, role in ROLES]


def demo_settings(
    workers: Sequence[EmulatedWorker],
    host: str,
    port: int,
    policy: str,
    *,
    admin_token: str | None = None,
    otlp_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """The demo's router: its workers, `policy`, the admin API under `admin_token` (none: off)
    and telemetry to `otlp_endpoint` (none: `/metrics` only); `OWNERSERVE_*` variables in
    `env` override as they do for `ownerserve serve`."""
    data: dict[str, Any] = {
        "server": {"host": host, "port": port},
        # the comparison picks its routers per request (x-ownerserve-policy)
        "planner": {"policy": policy, "allow_policy_header": True},
        "models": [{"name": MODEL}],
        "workers": [w.worker_settings() for w in workers],
    }
    given = {"OWNERSERVE_SERVER__HOST", "OWNERSERVE_SERVER__PORT", "OWNERSERVE_PLANNER__POLICY"}
    if admin_token:
        data["server"]["admin_token"] = admin_token
        given.add("OWNERSERVE_SERVER__ADMIN_TOKEN")
    if otlp_endpoint:
        data["telemetry"] = {"otlp_endpoint": otlp_endpoint}
        given.add("OWNERSERVE_TELEMETRY__OTLP_ENDPOINT")
    # what a flag gave wins over the environment, as with `serve`
    rest = {k: v for k, v in (env or {}).items() if k.upper() not in given}
    return settings_from_dict(data, source="<demo>", env=rest)


def _repo(name: str, modules: int) -> str:
    return "".join(
        f"# file {name}/module_{i}.py\ndef handler_{i}(request):\n"
        f"    return route(request, shard={i}, retries=3)\n\n"
        for i in range(modules)
    )


SYSTEM = "You are a coding agent. Use the tools to inspect and edit the repository.\n"
REPO_A = _repo("src", 60)
REPO_B = _repo("svc", 45)
SHORT_TOOL = "PASSED tests/test_router.py::test_health\n" * 3
LONG_TOOL = "Traceback (most recent call last):\n  File 'src/module_7.py', line 3\n" * 40
DIFF_TOOL = "diff --git a/src/module_7.py b/src/module_7.py\n+    return route(request)\n" * 4


@dataclass(frozen=True, slots=True)
class Step:
    """One request of the demo's script: `session` sends `content` (its first turn: the whole
    prompt after the system message; later ones: a tool output or a user message) and waits
    for the answer, unless `with_next` runs it beside the next step (two sessions competing)."""

    session: str
    what: str
    content: str
    role: str = "tool"
    parent: str | None = None
    fork_of: str | None = None
    """A subagent's first turn starts from this session's first prompt (its shared prefix)."""
    with_next: bool = False


SCRIPT: tuple[Step, ...] = (
    Step("A", "long new prefix", "Repository:\n" + REPO_A + "\nFix the failing test.", "user"),
    Step("A", "small increment", SHORT_TOOL),
    Step("A", "long tool output", LONG_TOOL),
    Step(
        "A/sub",
        "subagent on A's prefix",
        "Subtask: write a test for module 7.",
        "user",
        parent="A",
        fork_of="A",
    ),
    Step(
        "B",
        "competing new prefix",
        "Repository:\n" + REPO_B + "\nAdd retries.",
        "user",
        with_next=True,
    ),
    Step("A", "increment beside B", DIFF_TOOL),
    Step("B", "B's increment", SHORT_TOOL, with_next=True),
    Step("A/sub", "subagent's next turn", SHORT_TOOL),
)
"""What the planner is for, in eight requests: a long new prefix, small increments, a long
tool output, a subagent forked from its parent's prefix, a second session competing for the
same workers."""

COMPARED = ("round-robin", "vllm-consistent-hash")
"""The routers the demo replays its script under, beside its own policy: round robin, and a
sticky router (vllm-router's consistent hash on the session id)."""
STICKY_NAMES = {"vllm-consistent-hash": "sticky (session hash)"}


@dataclass(frozen=True, slots=True)
class TurnResult:
    step: int
    session: str
    what: str
    request_class: str
    action: str
    workers: str
    runner_up: str
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RunResult:
    """The script under one router: its turns and the cluster's KV economics over it."""

    policy: str
    turns: tuple[TurnResult, ...]
    wall_s: float
    cluster: ClusterStats
    available: float | None
    """The share of the prompts' tokens the directory held anywhere (the router's
    `ownerserve_prefix_tokens_total`, available over prompt)."""
    delivered: float | None
    """The share the engines reported cached (delivered over reported)."""


async def _stream_turn(
    client: httpx.AsyncClient,
    messages: list[dict[str, Any]],
    headers: dict[str, str],
) -> tuple[str, dict[str, str], float, float, dict[str, Any]]:
    from planner.explain import parse_plan_header

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
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"proxy answered {resp.status_code}: {detail}")
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


async def run_script(
    base_url: str, steps: Sequence[Step], run: str, policy: str | None = None
) -> list[TurnResult]:
    """`steps` through the proxy as one run: its sessions named after `run`, whose name also
    opens every system prompt (no run reuses another's KV); `policy` picks the router
    (`x-ownerserve-policy`; None: the proxy's own)."""
    system = {"role": "system", "content": f"[{run}] {SYSTEM}"}
    history: dict[str, list[dict[str, Any]]] = {}
    results: list[TurnResult] = []

    async def one(index: int, step: Step, client: httpx.AsyncClient) -> TurnResult:
        messages = history.get(step.session)
        if messages is None:
            first = history[step.fork_of][:2] if step.fork_of else [system]
            messages = history[step.session] = list(first)
        messages.append({"role": step.role, "content": step.content})
        headers = {"x-session-id": f"demo-{run}-{step.session}"}
        if step.parent is not None:
            headers["x-parent-session-id"] = f"demo-{run}-{step.parent}"
        if policy is not None:
            headers["x-ownerserve-policy"] = policy
        text, plan, ttft, e2e, usage = await _stream_turn(client, list(messages), headers)
        messages.append({"role": "assistant", "content": text})
        details = usage.get("prompt_tokens_details") or {}
        return TurnResult(
            step=index,
            session=step.session,
            what=step.what,
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

    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        batch: list[tuple[int, Step]] = []
        for index, step in enumerate(steps, 1):
            batch.append((index, step))
            if step.with_next and index < len(steps):
                continue
            results += await asyncio.gather(*(one(i, s, client) for i, s in batch))
            batch = []
    return results


async def _reset(workers: Sequence[EmulatedWorker]) -> None:
    """Every worker's prefix cache and CPU tier dropped: each run starts cold."""
    async with httpx.AsyncClient(timeout=30.0) as http:
        for w in workers:
            resp = await http.post(w.url + "/reset_prefix_cache", params={"reset_external": "true"})
            resp.raise_for_status()


def _prefix_tokens(text: str) -> dict[str, float]:
    """The router's `ownerserve_prefix_tokens_total` summed by kind."""
    out: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if name == "ownerserve_prefix_tokens_total":
            kind = dict(labels).get("kind", "")
            out[kind] = out.get(kind, 0.0) + value
    return out


def _share(num: float, den: float) -> float | None:
    return num / den if den else None


async def run_compared(
    base_url: str,
    workers: Sequence[EmulatedWorker],
    steps: Sequence[Step],
    policy: str,
    compared: Sequence[str],
) -> list[RunResult]:
    """The script once under the proxy's own `policy`, then under each of `compared`, each run
    on cold caches, with the KV economics each run left: the workers' counters (prefill
    computed, KV moved, the duplicate factor at its end) and the router's prefix reuse."""
    urls = [w.url for w in workers]
    runs: list[RunResult] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        for run_policy in (policy, *compared):
            await _reset(workers)
            before, router_before = await snapshot_all(urls), (await client.get("/metrics")).text
            t0 = time.perf_counter()
            name = run_policy.replace("vllm-consistent-hash", "sticky")
            header = None if run_policy == policy else run_policy
            turns = await run_script(base_url, steps, name, header)
            wall = time.perf_counter() - t0
            after, router_after = await snapshot_all(urls), (await client.get("/metrics")).text
            a, b = _prefix_tokens(router_after), _prefix_tokens(router_before)
            d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
            runs.append(
                RunResult(
                    policy=run_policy,
                    turns=tuple(turns),
                    wall_s=wall,
                    cluster=cluster_stats(after, before),
                    available=_share(d.get("available", 0.0), d.get("prompt", 0.0)),
                    delivered=_share(d.get("delivered", 0.0), d.get("reported", 0.0)),
                )
            )
    return runs


def _table(title: str, head: str) -> list[str]:
    """A report's first lines: a blank line, `title`, the column heads and a rule under them."""
    return ["", title, head, "-" * len(head)]


def format_report(results: Sequence[TurnResult]) -> str:
    head = (
        f"{'step':>4}  {'session':<6} {'what':<24} {'request class':<22} {'action':<19} "
        f"{'workers':<10} {'TTFT ms':>7} {'E2E ms':>7} {'prompt':>6} {'cached':>6}  runner-up"
    )
    lines = _table("OwnerServe demo: an agent session, its subagent and a competing session", head)
    for r in results:
        lines.append(
            f"{r.step:>4}  {r.session:<6} {r.what:<24} {r.request_class:<22} {r.action:<19} "
            f"{r.workers:<10} {r.ttft_s * 1e3:>7.1f} {r.e2e_s * 1e3:>7.1f} "
            f"{r.prompt_tokens:>6} {r.cached_tokens:>6}  {r.runner_up}"
        )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f} MiB"


def format_comparison(runs: Sequence[RunResult]) -> str:
    """The KV economics of each run side by side."""
    head = (
        f"{'router':<22} {'computed':>8} {'cached':>7} {'reuse held':>10} {'delivered':>9} "
        f"{'KV moved':>10} {'dup':>5} {'TTFT p50':>9} {'wall s':>6}"
    )
    lines = _table(
        "The same steps under each router (cold caches each run; every prompt opens with the "
        "run's name, so no run reuses another's KV):",
        head,
    )
    for r in runs:
        c = r.cluster
        moved = None if c.kv_bytes_pd is None else c.kv_bytes_pd + (c.kv_bytes_fetch or 0)
        ttfts = sorted(t.ttft_s for t in r.turns)
        p50 = ttfts[len(ttfts) // 2] * 1e3 if ttfts else 0.0
        dup = "-" if c.duplicate_factor is None else f"{c.duplicate_factor:.2f}"
        lines.append(
            f"{STICKY_NAMES.get(r.policy, r.policy):<22} {c.prefill_tokens_computed or 0:>8} "
            f"{sum(t.cached_tokens for t in r.turns):>7} {_pct(r.available):>10} "
            f"{_pct(r.delivered):>9} {_mib(moved):>10} {dup:>5} {p50:>7.1f}ms {r.wall_s:>6.1f}"
        )
    lines += [
        "",
        "computed: prompt tokens the engines prefilled; cached: what they reported reused; "
        "reuse held: the prompts' share the directory held anywhere; delivered: the share the "
        "engines reported cached; KV moved: P->D hand-overs and fetches; dup: GPU copies per "
        "distinct block at the run's end.",
    ]
    return "\n".join(lines)


async def _main(args: argparse.Namespace, workers: Sequence[EmulatedWorker]) -> int:
    from router.server import SHUTDOWN_GRACE_S, running, stop_on_signals

    settings = demo_settings(
        workers,
        args.host,
        args.port,
        args.policy,
        admin_token=args.admin_token,
        otlp_endpoint=args.otlp_endpoint,
        env=os.environ,
    )
    compared = [] if args.no_compare else [p for p in COMPARED if p != args.policy]
    steps = SCRIPT[: args.steps]
    stop = asyncio.Event()
    async with running(settings) as base_url:
        # the signals only set `stop`; leaving `running` drains as `ownerserve serve` does
        with stop_on_signals(stop):
            demo = run_compared(base_url, workers, steps, args.policy, compared)
            if not await _demo_unless_stopped(demo, stop) and not args.once:
                serving = f"Serving the OpenAI API at {base_url}/v1 (model {MODEL!r})"
                print(f"\n{serving}; Ctrl-C to stop.", flush=True)
                await stop.wait()
        if stop.is_set():
            print(
                f"Stopping: requests in flight get up to {SHUTDOWN_GRACE_S:g} s to finish.",
                flush=True,
            )
    return 0


async def _demo_unless_stopped(
    demo: Coroutine[Any, Any, list[RunResult]], stop: asyncio.Event
) -> bool:
    """Run the demo's script and print its report; True when `stop` came first (the script,
    the demo's own client, is then dropped)."""
    runs = asyncio.create_task(demo)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({runs, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not runs.done():
            await cancel_and_wait(runs)
    if not runs.done() or runs.cancelled():
        return True
    results = runs.result()
    print(format_report(results[0].turns), flush=True)
    if len(results) > 1:
        print(format_comparison(results), flush=True)
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
