"""The router's instructions per request, counted by callgrind: a measure of the request path's
CPU that the machine's load does not move (the CPU seconds `bench.router_overhead.run` reads on
a shared 2-core VM vary by 2x and more from run to run; an A/B of a few percent needs this).

    .venv/bin/python -m bench.router_overhead.icount [--scenario repeated|stream|agent] \
        [--request-log] [--policy round-robin]
    .venv/bin/python -m bench.router_overhead.icount --scenario agent-128k --few 16 --many 48

Runs the router in-process on its own HTTP server, with the bench's two fast backends in their
own processes (not counted), and sends it requests one after another over one keep-alive
connection from a client in the same process (counted: the raw protocol of
`bench.router_overhead.load`, the same in any A/B). It does that under `valgrind
--tool=callgrind` twice, with `--few` and `--many` requests, and prints the difference of the
two counts over the difference of the requests: startup and shutdown cancel out. Health checks
are made rare (600 s) so that none lands in the window; the prompts: `repeated` (64 prompts
cycled, not streamed), `stream` (the same, streamed), `agent` (8-turn sessions, streamed),
`agent-8k`, `agent-32k`, `agent-128k` (the run's long agent sessions, `load.AgentSession`, of
`run.LONG_TURNS` turns, not streamed: give `--few` and `--many` as whole sessions).
Takes about ten minutes (callgrind runs Python some 50x slower). `--request-log` counts with the
per-request log line on, as `ownerserve serve` writes it (its logger at INFO, a stream handler
on stderr, `logging.basicConfig`'s format); without it the line is off (its logger at WARNING:
`RequestRecord.emit` builds nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.router_overhead.load import AgentSession, Client, bodies
from bench.router_overhead.run import LONG_TURNS, MODEL, REPO, ownerserve_config, started
from ownerserve.config import load_settings
from ownerserve.ports import free_port

SCENARIOS = {"repeated": (False, 0, 0), "stream": (True, 0, 0), "agent": (True, 8, 0)}
"""name -> (streamed, turns per session, characters a long session grows to)"""
SCENARIOS.update({f"agent-{k}k": (False, LONG_TURNS, k * 1024) for k in (8, 32, 128)})


async def _serve(
    n: int, stream: bool, turns: int, request_log: bool, grow_to: int = 0, policy: str = ""
) -> None:
    """`n` requests through the router, one after another."""
    from router.requestlog import REQUEST_LOGGER
    from router.server import running

    if request_log:  # as `ownerserve serve` sets it up
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)

    backends = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        for p in backends:
            stack.enter_context(
                started([sys.executable, "-m", "bench.router_overhead.backend", "--port", str(p)])
            )
        cfg = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "router.yaml"
        ownerserve_config(cfg, 0, backends, policy or "ownerserve")
        cfg.write_text(cfg.read_text().replace("health_interval_s: 2.0", "health_interval_s: 600"))
        await asyncio.sleep(3.0)  # the backends listen
        async with running(load_settings(cfg)) as url:
            gc.collect()
            gc.freeze()
            host, port = url.rsplit("//", 1)[1].split(":")
            if grow_to:
                agent = AgentSession(MODEL, 0, stream, f"{host}:{port}", grow_to, turns)
                prompts = [r for r, _ in zip(agent.requests(), range(n), strict=False)]
            else:
                prompts = bodies(MODEL, 0, n if turns else 64, stream, f"{host}:{port}", turns)
            loop = asyncio.get_running_loop()
            transport, proto = await loop.create_connection(Client, host, int(port))
            for i in range(n):
                proto.waiter = loop.create_future()
                transport.write(prompts[i % len(prompts)])
                status = await proto.waiter
                if status != 200:
                    raise SystemExit(f"request {i}: status {status}")
            transport.close()


def _count(n: int, scenario: str, request_log: bool, policy: str) -> int:
    """Instructions callgrind counted in a run of `n` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
             sys.executable, "-m", "bench.router_overhead.icount", "--serve", str(n),
             "--scenario", scenario, *(["--request-log"] if request_log else []),
             *(["--policy", policy] if policy else [])],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no count in callgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="repeated")
    ap.add_argument("--few", type=int, default=20)
    ap.add_argument("--many", type=int, default=520)
    ap.add_argument("--request-log", action="store_true", help="with the per-request log line on")
    ap.add_argument("--policy", default="", help="the router's policy (default ownerserve)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # one counted run
    args = ap.parse_args(argv)
    stream, turns, grow_to = SCENARIOS[args.scenario]
    if args.serve is not None:
        uvloop.run(_serve(args.serve, stream, turns, args.request_log, grow_to, args.policy))
        return 0
    few = _count(args.few, args.scenario, args.request_log, args.policy)
    many = _count(args.many, args.scenario, args.request_log, args.policy)
    per_request = (many - few) / (args.many - args.few)
    log = (", request log on" if args.request_log else "") + (
        f", policy {args.policy}" if args.policy else ""
    )
    print(f"{args.scenario}{log}: {per_request:,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
