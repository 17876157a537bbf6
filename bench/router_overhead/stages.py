"""The router's routing steps timed one by one, in one process, over the overhead bench's own
prompts, through the request path's own stages (`router.stages`, `router.aftermath`), each
given its services from `Router.services` as the runner (`router.pipeline`) gives them:
parse, identify, tokenize (+ block hashes), directory lookup, request view, plan (cluster
view + policy), plan header, commit, observe. No HTTP: this isolates what the request path
computes from what the server and the upstream client cost (`bench.router_overhead.servers`).

    .venv/bin/python -m bench.router_overhead.stages [--prompts repeated|new|agent]

`repeated`: 256 single-message prompts cycled (the bench's non-stream c=1 steady state);
`new`: 16 connections' prompts, each seen once (every one hashed and claimed afresh);
`agent`: 16 connections' 8-turn agent sessions with `x-session-id`, as the bench sends them.
Prints µs per request per step (perf_counter; the first pass over the prompts is warm-up).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

import uvloop

from bench.router_overhead.load import bodies
from bench.router_overhead.run import MODEL
from ownerserve.config import settings_from_dict
from router.aftermath import commit, observe
from router.plans import PlanRecord, plan_header
from router.requests import Endpoint, parse_request
from router.stages import identify, look_up, model_label, plan, served_model, tokenize, view
from router.state import Router


def _requests(kind: str) -> tuple[list[tuple[bytes, str | None]], int]:
    """(body, session header) per request, and how many of them are warm-up."""
    unkeyed: list[tuple[bytes, str | None]]
    if kind == "repeated":
        raw = bodies(MODEL, 0, 256, False, "h")
        unkeyed = [(r.split(b"\r\n\r\n", 1)[1], None) for r in raw]
        return unkeyed * 8, 256
    if kind == "new":
        raw = [r for c in range(16) for r in bodies(MODEL, c, 256, False, "h")]
        unkeyed = [(r.split(b"\r\n\r\n", 1)[1], None) for r in raw]
        return unkeyed, 1024
    raw = [r for c in range(16) for r in bodies(MODEL, c, 256, True, "h", 8)]
    out = []
    for r in raw:
        found = re.search(rb"x-session-id: (\S+)", r)
        out.append((r.split(b"\r\n\r\n", 1)[1], found.group(1).decode() if found else None))
    return out, 1024


async def _run(kind: str) -> dict[str, float]:
    settings = settings_from_dict(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "planner": {"policy": "ownerserve", "profile": "fast-test"},
            "models": [{"name": MODEL, "tokenizer": "byte", "block_size": 16}],
            "workers": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{9000 + i}", "role": "hybrid",
                 "kind": "vllm", "models": [MODEL]}
                for i in range(2)
            ],
        }
    )  # fmt: skip
    router = Router(settings)
    await router.open_directory()  # the in-process directory: commits run inline
    svc = router.services
    requests, warmup = _requests(kind)
    totals: dict[str, float] = {}
    clock = time.perf_counter

    def timed(name: str, start: float) -> float:
        now = clock()
        totals[name] = totals.get(name, 0.0) + (now - start)
        return now

    step: Callable[[str, float], float] = timed
    for k, (body, sid_header) in enumerate(requests):
        if k == warmup:
            totals.clear()
        raw = [(b"host", b"h"), (b"content-type", b"application/json")]
        if sid_header:
            raw.append((b"x-session-id", sid_header.encode()))
        t = clock()
        headers = {n.decode("latin-1"): v.decode("latin-1") for n, v in raw}
        req = parse_request(body, Endpoint.CHAT)
        model_label(svc.parse, req.model)
        mt = served_model(svc.parse, req.model)
        t = step("parse", t)
        session = identify(req, headers, svc.derived_sessions)
        t = step("identify (session id)", t)
        prompt = tokenize(req, mt, session, svc.sessions)
        t = step("tokenize + hash", t)
        match, holders = await look_up(svc.look_up, prompt)
        t = step("directory lookup", t)
        policy, rview, _ = view(svc.view, headers, prompt, match)
        t = step("request view", t)
        planned = plan(policy, rview, svc.cluster, match, (), holders)
        assert planned is not None
        t = step("plan (cluster view + planner)", t)
        plan_header(planned, None)
        PlanRecord.of(planned, prompt.session.session_id, None)
        t = step("plan header + record", t)
        await commit(svc.commit, planned, prompt, match)
        t = step("commit", t)
        observe(svc.observe, planned, match, None, True, None, None, 0.0, None)
        step("observe (metrics)", t)
    n = len(requests) - warmup
    return {name: total * 1e6 / n for name, total in totals.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", choices=("repeated", "new", "agent"), default="repeated")
    args = ap.parse_args(argv)
    result = uvloop.run(_run(args.prompts))
    print(f"| step ({args.prompts} prompts) | µs/request |")
    print("| --- | ---: |")
    for name, us in result.items():
        print(f"| {name} | {us:.1f} |")
    print(f"| total | {sum(result.values()):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
