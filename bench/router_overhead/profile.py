"""Where the router's CPU goes under the overhead bench's load: the router runs in this
process under cProfile (or with no profiler, to read its CPU per request), the two fast
backends and the load generator in their own processes.

    .venv/bin/python -m bench.router_overhead.profile [--scenario "non-stream c=1"] [--secs 4]
        [--policy ownerserve] [--top 40] [--no-profile]

Prints the router's CPU µs per request (this process's `process_time` over the measured
window; inflated by cProfile's own cost unless `--no-profile`) and the top functions by own
time. A tool for finding hot spots, not a result: results come from `bench.router_overhead.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from bench.router_overhead.run import (
    MODEL,
    REPO,
    SCENARIOS,
    bpe_tokenizer,
    ownerserve_config,
    started,
)
from ownerserve.config import load_settings
from ownerserve.ports import free_port


async def _main(args: argparse.Namespace) -> int:
    from router.server import running

    scenario = SCENARIOS[args.scenario]
    backends = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        for p in backends:
            stack.enter_context(
                started([sys.executable, "-m", "bench.router_overhead.backend", "--port", str(p)])
            )
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        cfg = tmp / "router.yaml"
        tok_spec = str(bpe_tokenizer(tmp / "bpe")) if args.tokenizer == "bpe" else "byte"
        ownerserve_config(cfg, 0, backends, args.policy, tok_spec)
        settings = load_settings(cfg)
        await asyncio.sleep(1.0)
        async with running(settings) as url:
            gc.collect()
            gc.freeze()
            port = url.rsplit(":", 1)[1]
            cmd = [sys.executable, "-m", "bench.router_overhead.load", "--targets",
                   f"127.0.0.1:{port}", "--secs", str(args.secs), "--warmup", "1.0",
                   "--model", MODEL, *scenario.load_args()]  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=REPO, stdout=asyncio.subprocess.PIPE
            )
            await asyncio.sleep(1.0)
            prof = None if args.no_profile else cProfile.Profile()
            c0 = time.process_time()
            if prof is not None:
                prof.enable()
            out, _ = await proc.communicate()
            if prof is not None:
                prof.disable()
            cpu = time.process_time() - c0
    res = json.loads(out.decode().strip().splitlines()[-1])
    n = max(1, res["requests"])
    print(
        f"# {args.scenario}, policy {args.policy}: {res['requests']} requests, "
        f"{res['rps']:.0f} req/s, router CPU {cpu * 1e6 / n:.1f} µs/req"
        f"{'' if prof is None else ' (with cProfile)'}, p50 {res['p50_ms']:.3f} ms"
    )
    if prof is not None:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats(args.sort).print_stats(args.top)
        print(s.getvalue())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="non-stream c=1", choices=sorted(SCENARIOS))
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    ap.add_argument("--secs", type=float, default=4.0)
    ap.add_argument("--policy", default="ownerserve")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args(argv)
    return uvloop.run(_main(args))


if __name__ == "__main__":
    raise SystemExit(main())
