"""Router overhead, side by side in one run: the OwnerServe proxy (ownerserve policy, and
round-robin to separate planning from proxying) vs direct to the backends vs vllm-router
(round_robin) vs sglang-router (round_robin), all in front of the same two near-zero-cost
backends (`bench.router_overhead.backend`), driven by `bench.router_overhead.load`.

Per target and scenario: router CPU µs per request (utime+stime of the router's process tree
from /proc over the measured window, divided by requests), throughput, latency p50/p99, and
the latency each router adds over going direct. Scenarios: non-streaming and streaming, at 1
connection (latency) and 16 connections (throughput), keep-alive throughout.

    .venv/bin/python -m bench.router_overhead.run [--secs 8] [--out FILE.json]

Peers come from `bench/peers/setup_peers.sh` (their own venvs); a peer that cannot be
installed is reported as missing, not faked.
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
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from ownerserve.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HZ = os.sysconf("SC_CLK_TCK")
MODEL = "bench-model"
SCENARIOS: tuple[tuple[str, bool, int, int], ...] = (
    # label, stream, connections, turns per agent session (0: every prompt new)
    ("non-stream c=1", False, 1, 0),
    ("non-stream c=16", False, 16, 0),
    ("stream c=1", True, 1, 0),
    ("stream c=16", True, 16, 0),
    ("agent sessions stream c=16", True, 16, 8),
)


def proc_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    except OSError:
        return out
    pairs = [tuple(map(int, r.split())) for r in rows.splitlines()[1:] if r.strip()]
    changed = True
    while changed:
        changed = False
        for p, pp in pairs:
            if pp in out and p not in out:
                out.append(p)
                changed = True
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / HZ
    return total


def wait_http(
    url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout_s}s")


@dataclass
class Target:
    name: str
    port: int | None  # None: direct to the backends
    proc: subprocess.Popen[bytes] | None = None


@contextlib.contextmanager
def started(cmd: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def ownerserve_config(path: Path, port: int, backends: list[int], policy: str) -> None:
    workers = "\n".join(
        f'  - {{id: b{i}, url: "http://127.0.0.1:{p}", role: hybrid, kind: vllm, '
        f"models: [{MODEL}]}}"
        for i, p in enumerate(backends)
    )
    path.write_text(
        f"server: {{host: 127.0.0.1, port: {port}, health_interval_s: 2.0}}\n"
        f"planner: {{policy: {policy}, profile: fast-test}}\n"
        f"models: [{{name: {MODEL}, tokenizer: byte, block_size: 16}}]\n"
        f"workers:\n{workers}\n"
    )


def peer(name: str) -> Path | None:
    sys.path.insert(0, str(REPO))
    from loadgen.peers import PeerUnavailableError, peer_binary

    try:
        return peer_binary(name)
    except PeerUnavailableError as exc:
        print(f"# {name} unavailable: {exc}", file=sys.stderr)
        return None


def measure(
    target: Target, backends: list[int], stream: bool, conns: int, turns: int, secs: float
) -> dict[str, Any]:
    if target.port is None:
        dest = ",".join(f"127.0.0.1:{p}" for p in backends)
    else:
        dest = f"127.0.0.1:{target.port}"
    pids = proc_tree(target.proc.pid) if target.proc is not None else []
    cmd = [sys.executable, "-m", "bench.router_overhead.load", "--targets", dest, "-c",
           str(conns), "--secs", str(secs), "--warmup", "1.0", "--model", MODEL]  # fmt: skip
    if stream:
        cmd.append("--stream")
    if turns:
        cmd += ["--session-turns", str(turns)]
    # CPU is read around the measured window only: the load runs `warmup` seconds first
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    c0 = cpu_seconds(pids)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=secs + 60)
    c1 = cpu_seconds(pids)
    elapsed = time.monotonic() - t0
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    n = max(1, res["requests"])
    # scale the CPU window to the measured seconds (communicate returns a bit after `stop`)
    cpu = (c1 - c0) * min(1.0, secs / elapsed) if pids else None
    res["router_cpu_us_per_req"] = None if cpu is None else round(cpu * 1e6 / n, 1)
    return res


def run(secs: float, targets_wanted: list[str]) -> dict[str, Any]:
    backends = [free_port(), free_port()]
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for p in backends:
            proc = stack.enter_context(started(
                [sys.executable, "-m", "bench.router_overhead.backend", "--port", str(p),
                 "--model", MODEL]))  # fmt: skip
            wait_http(f"http://127.0.0.1:{p}/health", proc=proc)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls = [f"http://127.0.0.1:{p}" for p in backends]
        for name in targets_wanted:
            port = free_port()
            cmd: list[str] | None = None
            if name == "direct":
                target = Target(name, None)
            elif name.startswith("ownerserve"):
                policy = "round-robin" if name.endswith("round-robin") else "ownerserve"
                cfg = tmp / f"{policy}.yaml"
                ownerserve_config(cfg, port, backends, policy)
                cmd = [sys.executable, "-m", "ownerserve", "serve", "--config", str(cfg)]
            elif name == "vllm-router":
                binary = peer("vllm-router")
                if binary is not None:
                    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *urls, "--policy", "round_robin",
                           "--prometheus-host", "127.0.0.1", "--prometheus-port",
                           str(free_port()), "--log-level", "error"]  # fmt: skip
            elif name == "sglang-router":
                binary = peer("sglang-router")
                if binary is not None:
                    cmd = [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port),
                           "--worker-urls", *urls, "--policy", "round_robin",
                           "--prometheus-host", "127.0.0.1", "--prometheus-port",
                           str(free_port()), "--log-level", "error"]  # fmt: skip
            if name != "direct" and cmd is None:
                results[name] = {"missing": True}
                continue
            with contextlib.ExitStack() as tstack:
                if cmd is not None:
                    proc = tstack.enter_context(started(cmd))
                    target = Target(name, port, proc)
                    wait_http(f"http://127.0.0.1:{port}/v1/models", proc=proc)
                    time.sleep(1.0)  # first health checks
                per: dict[str, Any] = {}
                for label, stream, conns, turns in SCENARIOS:
                    per[label] = measure(target, backends, stream, conns, turns, secs)
                    print(f"# {name:26s} {label:16s} {json.dumps(per[label])}", file=sys.stderr)
                results[name] = per
    return results


def table(results: dict[str, Any]) -> str:
    direct = results.get("direct", {})
    lines = [
        "| target | scenario | router CPU µs/req | req/s | vs direct | p50 ms | p99 ms | "
        "added p50 ms | added p99 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, per in results.items():
        if per.get("missing"):
            lines.append(f"| {name} | (not installed) | | | | | | | |")
            continue
        for label, r in per.items():
            d = direct.get(label)
            ratio = f"{r['rps'] / d['rps']:.2f}" if d else ""
            add50 = f"{r['p50_ms'] - d['p50_ms']:.3f}" if d and name != "direct" else ""
            add99 = f"{r['p99_ms'] - d['p99_ms']:.3f}" if d and name != "direct" else ""
            cpu = r.get("router_cpu_us_per_req")
            lines.append(
                f"| {name} | {label} | {'' if cpu is None else cpu} | {r['rps']:.0f} | {ratio} "
                f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {add50} | {add99} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=8.0, help="measured seconds per scenario")
    ap.add_argument(
        "--targets",
        default="direct,ownerserve,ownerserve round-robin,vllm-router,sglang-router",
        help="comma-separated subset",
    )
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args(argv)
    results = run(args.secs, [t.strip() for t in args.targets.split(",") if t.strip()])
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
        "secs": args.secs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"date {meta['date']}; {meta['machine']}; {args.secs:g} s per scenario\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
