"""The agentic benchmark's workload in the cluster simulator: quick feedback on planner changes.

    .venv/bin/python -m bench.planner.sim_mixed [--workload mixed|trace]
        [--policies ownerserve,static-pd,...] [--planner lam=1e-9 --planner mu=1]
        [--scale 1] [--seed 0] [--json FILE]

`ownerserve bench agentic` replays the `mixed` workload and the last 1000 rows of the Mooncake
trace through the router on 2 prefill + 2 decode + 2 hybrid emulated workers (10+ minutes on
this machine). This runs the same sessions (`loadgen.sim.from_workload`: the emulator's block
hashes; the trace scaled as the bench scales it: 32 tokens per hash id, outputs capped at 24)
on the simulator's 2/2/2 cluster with the emulator's KV capacity and the router's 2 s load
scrape (as `bench.sim.validate` does), in seconds per policy. Times are GPU time: the bench
runs the emulators at speed 2 with arrivals ×1/2 in wall time, so its wall-clock figures are
these ÷ 2. `--planner key=value` sets a `planner.cost.CostConfig` field of the ownerserve
policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from loadgen.cluster import REPO_ROOT
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.from_workload import workload_sessions
from loadgen.trace import TraceScaling, load_trace, trace_workload
from loadgen.workloads import Workload, generate
from ownerserve.profiles import load_profile
from planner.cost import CostConfig
from planner.policies import get_policy

EMULATOR_CAPACITY_BLOCKS = 19_073
"""KV blocks of one emulated worker (profile h100-llama3-8b, 16-token blocks), as measured by
`bench.sim.validate` against the running emulator."""

TRACE = REPO_ROOT / "data" / "mooncake_synthetic_trace.jsonl"
BENCH_SPEED = 2.0
"""`ownerserve bench agentic`'s default: emulated GPU time runs 2× faster than wall time."""

DEFAULT_POLICIES = "ownerserve,static-pd,colocated,round-robin,prefix-multi-owner,least-loaded"


def _config(items: list[str]) -> CostConfig:
    fields = {f.name: f for f in dataclasses.fields(CostConfig)}
    kw: dict[str, Any] = {}
    for item in items:
        key, _, val = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown CostConfig field {key!r}")
        cur = getattr(CostConfig(), key)
        kw[key] = type(cur)(float(val)) if isinstance(cur, (int, float)) else val
    return CostConfig(**kw)


def workload(name: str, scale: float, seed: int) -> Workload:
    """The bench's workload in GPU time (the bench replays it ×1/speed in wall time)."""
    if name == "mixed":
        return generate("mixed", seed, scale)
    if name == "trace":
        rows = load_trace(TRACE, start=2993, limit=1000)
        # the bench replays timestamps ×0.125 in wall time: ×0.25 in GPU time at speed 2
        scaling = TraceScaling(block_tokens=32, max_output=24, time_scale=0.125 * BENCH_SPEED)
        return trace_workload(rows, scaling, seed=seed)
    raise SystemExit(f"unknown workload {name!r} (mixed or trace)")


def run(
    policies: list[str], config: CostConfig, scale: float, seed: int, name: str = "mixed"
) -> dict[str, Any]:
    profile = load_profile(config.profile)
    sessions = workload_sessions(workload(name, scale, seed))
    spec = ClusterSpec(
        2,
        2,
        2,
        block_tokens=16,
        hbm_kv_bytes=EMULATOR_CAPACITY_BLOCKS * 16 * profile.kv_bytes_per_token,
        load_scrape_s=2.0,
    )
    out: dict[str, Any] = {}
    for name in policies:
        policy = get_policy(name, config if name == "ownerserve" else None)
        res = Simulator(spec, profile, policy).run(sessions)
        s = res.summary()
        out[name] = {
            "e2e_mean_s": s["e2e_mean_s"],
            "e2e_p99_s": s.get("e2e_p99_s"),
            "ttft_mean_s": sum(res.ttft_s) / len(res.ttft_s) if res.ttft_s else None,
            "prefill_tokens": res.prefill_tokens,
            "kv_bytes": res.pd_kv_bytes + res.fetch_kv_bytes,
            "fetch_bytes": res.fetch_kv_bytes,
            "dup_factor": res.dup_factor,
            "interference_s": res.decode_interference_s,
            "actions": s["actions"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default="mixed", help="mixed or trace")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--planner", action="append", default=[], help="CostConfig field=value")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    out = run(policies, _config(args.planner), args.scale, args.seed, args.workload)
    print("| policy | E2E mean s | TTFT mean s | prefill tok | KV GB | fetch GB | dup | interf. s "
          "| actions |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in out.items():
        acts = ", ".join(f"{k} {v}" for k, v in sorted(r["actions"].items()))
        print(
            f"| {name} | {r['e2e_mean_s']:.2f} | {r['ttft_mean_s']:.3f} | {r['prefill_tokens']:,}"
            f" | {r['kv_bytes'] / 1e9:.1f} | {r['fetch_bytes'] / 1e9:.1f} | {r['dup_factor']:.2f}"
            f" | {r['interference_s']:.0f} | {acts} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
