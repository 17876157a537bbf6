"""`ownerserve sim`: compare routing policies on a simulated cluster; tables, JSON and plots."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.from_workload import Rendering, workload_sessions
from loadgen.sim.workload import SimSession, agentic_sessions, trace_sessions
from loadgen.workloads import GENERATORS, generate
from ownerserve.profiles import load_profile

# the load generator's named workloads, but for its `agentic`: here that is the simulator's own
LOADGEN_WORKLOADS = tuple(sorted(name for name in GENERATORS if name != "agentic"))

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("e2e_mean_s", "E2E mean s", "{:.2f}"),
    ("e2e_p95_s", "E2E p95 s", "{:.2f}"),
    ("e2e_p99_s", "E2E p99 s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("tpot_mean_s", "TPOT ms", "{:.1f}"),
    ("dup_factor", "dup HBM", "{:.2f}"),
    ("network_kv_gb", "net KV GB", "{:.1f}"),
    ("pd_kv_gb", "P→D GB", "{:.1f}"),
    ("prefill_tokens", "prefill Mtok", "{:.1f}"),
    ("decode_interference_s", "interf. s", "{:.0f}"),
    ("owner_hit_rate", "owner hit", "{:.2f}"),
    ("max_concurrent_sessions", "max sessions", "{:.0f}"),
    ("rejected", "rejected", "{}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="cluster size (split P:D:H 1:1:1)")
    parser.add_argument("--sessions", type=int, default=2000, help="agent sessions to simulate")
    parser.add_argument(
        "--workload",
        default="agentic",
        help="'agentic' (generated coding-agent sessions), 'trace:FILE' (Mooncake JSONL) or a "
        f"load-generator workload ({'|'.join(LOADGEN_WORKLOADS)}), block for block as the "
        "emulated cluster sees it (--sessions keeps the first N)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="load-generator workloads: generate's scale"
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="session arrivals per second (agentic)"
    )
    parser.add_argument(
        "--trace-repeat", type=int, default=1, help="tile the trace N times (disjoint ids)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="time multiplier of traces and load-generator workloads",
    )
    parser.add_argument(
        "--policies",
        default="ownerserve,static-pd,colocated,round-robin,prefix-multi-owner,least-loaded,oracle",
        help="comma-separated policies ('oracle' = ownerserve with future knowledge); the peer "
        "routers' models: sglang-cache-aware[-pd], vllm-cache-aware[-pd], vllm-consistent-hash, "
        "vllm-power-of-two, dynamo-kv[-disagg], llm-d[-pd], mooncake-conductor",
    )
    parser.add_argument(
        "--peer-cluster",
        choices=("native", "same"),
        default="native",
        help="the cluster the peers run on: 'native' = the same worker count in the peer's own "
        "deployment shape (aggregated peers: every worker hybrid; P/D peers: half prefill, half "
        "decode), 'same' = OwnerServe's P:D:H split",
    )
    parser.add_argument("--profile", default="h100-llama3-8b", help="timing profile")
    parser.add_argument("--hbm-gb", type=float, default=None, help="KV HBM per worker, GB")
    parser.add_argument(
        "--load-scrape-s",
        type=float,
        default=0.0,
        help="age of the workers' kv_usage the policies see: the router scrapes /metrics "
        "every server.health_interval_s (2 s by default); 0 = always current",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for JSON and plots")


def _workload(args: argparse.Namespace) -> list[SimSession]:
    if args.workload.startswith("trace:"):
        return trace_sessions(
            args.workload[6:], time_scale=args.time_scale, repeat=args.trace_repeat
        )[: args.sessions]
    if args.workload in LOADGEN_WORKLOADS:
        w = generate(args.workload, args.seed, args.scale).scaled(args.time_scale)
        block = ClusterSpec.of_size(args.workers).block_tokens  # the spec `run_policies` builds
        return workload_sessions(w, Rendering(block_size=block))[: args.sessions]
    if args.workload != "agentic":
        raise SystemExit(f"ownerserve sim: unknown workload {args.workload!r}")
    rate = args.rate if args.rate is not None else max(0.01, args.workers * 0.01)
    return agentic_sessions(args.sessions, rate, seed=args.seed)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for _, title, _ in TABLE_COLUMNS) + " |"
    sep = "|" + "---|" * len(TABLE_COLUMNS)
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in TABLE_COLUMNS:
            val = r[key]
            if key == "tpot_mean_s":
                val = val * 1e3
            if key == "prefill_tokens":
                val = val / 1e6
            cells.append(fmt.format(val))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_spec(spec: ClusterSpec, name: str) -> ClusterSpec:
    """The peer's own deployment shape with `spec`'s worker count: aggregated peers on hybrid
    workers only, P/D peers on half prefill and half decode workers."""
    from planner.policies.peers import DISAGGREGATED

    n = spec.total
    if name in DISAGGREGATED:
        return replace(spec, prefill=n // 2, decode=n - n // 2, hybrid=0)
    return replace(spec, prefill=0, decode=0, hybrid=n)


def run_policies(args: argparse.Namespace, sessions: list[SimSession]) -> list[dict[str, Any]]:
    from planner.policies import get_policy
    from planner.policies.peers import PEERS

    profile = load_profile(args.profile)
    hbm = int(args.hbm_gb * 1e9) if args.hbm_gb else None
    if args.load_scrape_s < 0:
        raise SystemExit("ownerserve sim: --load-scrape-s must be >= 0")
    spec = replace(
        ClusterSpec.of_size(args.workers, hbm_kv_bytes=hbm), load_scrape_s=args.load_scrape_s
    )
    rows = []
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        oracle = name == "oracle"
        policy = get_policy("ownerserve" if oracle else name)
        peer = name in PEERS
        # a peer's binary weighs every worker it routes to: its model sees them all
        sim = Simulator(
            peer_spec(spec, name) if peer and args.peer_cluster == "native" else spec,
            profile,
            policy,
            seed=args.seed,
            oracle=oracle,
            full_view=peer,
        )
        summary = sim.run(sessions).summary()
        summary["policy"] = name
        rows.append(summary)
        print(
            f"  {name:<20} {summary['requests']:>8} req  {summary['events']:>9} events  "
            f"{summary['wall_s']:6.1f}s wall  {summary['events_per_s']:>9.0f} ev/s",
            flush=True,
        )
    return rows


def main_rows(argv: list[str]) -> list[dict[str, Any]]:
    """Run `ownerserve sim` with `argv` and return the summary rows (for scripts and tests)."""
    parser = argparse.ArgumentParser(prog="ownerserve sim")
    add_arguments(parser)
    return _run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    _run(args)
    return 0


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    sessions = _workload(args)
    print(
        f"ownerserve sim: {len(sessions)} sessions, {args.workers} workers, "
        f"workload {args.workload} (built in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    rows = run_policies(args, sessions)
    print()
    print(markdown_table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        from loadgen.sim.plots import plot_rows

        plot_rows(rows, out)
        print(f"\nwrote {out}/sim.json and plots")
    return rows
