"""SWA checkpoint policies (LRU, full, periodic, zero, cost-based) on the agentic-long workload
in the simulator, for the V4-like and SWA-hybrid specs beside a dense one.

Usage: .venv/bin/python -m bench.heterocache.policies [--workers 8] [--sessions 60]
[--pressure 2] [--out bench/results]

Per spec the cluster's HBM is the same for every policy: the workload's peak working set of
sealed KV (`kv_working_set`, in the spec's blocks) over `--pressure` × workers, with a CPU
tier of 4× that behind it; the ownerserve policy plans with the spec (`RequestView.kv_spec`).
`lru` keeps every token's window entries with its block (a cache without typed parts); the
others keep sealed KV per block and windows per the SWA policy; `cost` is p* from
`cost_based_period` for this workload (n = mean final prompt, R = turns − 1 per session,
the CPU tier's bandwidth, α = 1 / that bandwidth; `cost-ssd`: α = 1 / the SSD's, a byte
written priced as an SSD write). Reported: HBM per session at the mean
final context and at 100K tokens, 100K-token sessions that fit in the profile's 40 GB of KV
HBM, each CPU-tier restore's load / recompute / wait for the prefill pipeline, bytes written
off-GPU (blocks offloaded + window checkpoints), TTFT and session E2E.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.from_workload import Rendering, workload_sessions
from loadgen.sim.workload import SimSession, kv_working_set
from loadgen.workloads import generate
from ownerserve.kvstate import KVStateSpec, SwaPolicy, cost_based_period, load_spec
from ownerserve.profiles import TimingProfile, load_profile
from ownerserve.types import Tier
from planner.policies import get_policy
from planner.restore import swa_cost_inputs

SPECS = ("llama3-8b", "qwen3-8b-swa", "deepseek-v4")
POLICIES = ("lru", "full", "periodic:4096", "zero", "cost", "cost-ssd")


def _policy(spec: KVStateSpec, name: str, p_star: dict[str, int]) -> tuple[KVStateSpec, bool]:
    if name == "lru":
        return replace(spec, swa_policy=SwaPolicy.full()), False
    if name == "full":
        return replace(spec, swa_policy=SwaPolicy.full()), True
    if name == "zero":
        return replace(spec, swa_policy=SwaPolicy.zero()), True
    if name in p_star:
        return replace(spec, swa_policy=SwaPolicy.cost_based(p_star[name])), True
    return replace(spec, swa_policy=SwaPolicy.periodic(int(name.split(":")[1]))), True


def _session_bytes(spec: KVStateSpec, tokens: int, typed: bool) -> float:
    return spec.total_bytes(tokens) + (0 if typed else tokens * spec.swa_bytes_per_token)


def run_spec(
    name: str, sessions: list[SimSession], prof: TimingProfile, args: argparse.Namespace
) -> list[dict[str, Any]]:
    spec = load_spec(name)
    bt = args.block_tokens
    peak, largest = kv_working_set(sessions, prof, bt)
    sealed_block = spec.bytes_per_token() * bt
    blocks = max(-(-peak // int(args.pressure * args.workers)), largest, 1)
    hbm = int(blocks * sealed_block)
    mean_ctx = sum(s.turns[-1].input_tokens for s in sessions) / len(sessions)
    turns = sum(len(s.turns) for s in sessions) / len(sessions)
    inputs = swa_cost_inputs(
        spec, prof, session_tokens=int(mean_ctx), restores=max(turns - 1, 0.0), tier=Tier.CPU
    )
    p_star = {
        "cost": cost_based_period(spec, inputs),
        "cost-ssd": cost_based_period(spec, replace(inputs, alpha=1 / prof.link.ssd_load_bps)),
    }
    names = POLICIES if spec.swa_recompute_tokens else ("full",)
    rows = []
    for pol_name in names:
        kv, typed = _policy(spec, pol_name, p_star)
        cluster = ClusterSpec(
            0, 0, args.workers, block_tokens=bt, hbm_kv_bytes=hbm, cpu_blocks=4 * blocks
        )
        sim = Simulator(
            cluster, prof, get_policy("ownerserve"), seed=args.seed, kv_spec=kv, typed_state=typed
        )
        t0 = time.perf_counter()
        res = sim.run(sessions)
        s = res.summary()
        per_100k = _session_bytes(kv, 100_000, typed)
        rows.append(
            {
                "spec": name,
                "policy": f"{pol_name} (p*={p_star[pol_name]})" if pol_name in p_star else pol_name,
                "hbm_per_session_gb": _session_bytes(kv, int(mean_ctx), typed) / 1e9,
                "hbm_per_100k_session_gb": per_100k / 1e9,
                "sessions_100k_per_40gb": int(prof.hbm_kv_bytes // per_100k),
                "restores": s["restores"],
                "restore_load_ms": s["restore_load_mean_s"] * 1e3,
                "restore_recompute_ms": s["restore_recompute_mean_s"] * 1e3,
                "restore_queue_ms": s["restore_queue_mean_s"] * 1e3,
                "restore_ms": s["restore_mean_s"] * 1e3,
                "written_gb": s["offload_gb"] + s["swa_written_gb"],
                "swa_written_gb": s["swa_written_gb"],
                "ttft_p50_s": s["ttft_p50_s"],
                "ttft_p99_s": s["ttft_p99_s"],
                "e2e_mean_s": s["e2e_mean_s"],
                "cpu_hit_mtok": s["cpu_hit_tokens"] / 1e6,
                "hbm_per_worker_gb": hbm / 1e9,
                "wall_s": time.perf_counter() - t0,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


COLUMNS = (
    ("spec", "spec", "{}"),
    ("policy", "policy", "{}"),
    ("hbm_per_session_gb", "HBM/session GB", "{:.3f}"),
    ("sessions_100k_per_40gb", "100K sessions /40 GB", "{}"),
    ("restores", "restores", "{}"),
    ("restore_load_ms", "load ms", "{:.1f}"),
    ("restore_recompute_ms", "recompute ms", "{:.1f}"),
    ("restore_queue_ms", "queue ms", "{:.1f}"),
    ("restore_ms", "restore ms", "{:.1f}"),
    ("written_gb", "written GB", "{:.2f}"),
    ("swa_written_gb", "of it windows GB", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("e2e_mean_s", "E2E mean s", "{:.1f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(t for _, t, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(f.format(r[k]) for k, _, f in COLUMNS) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--pressure", type=float, default=2.0)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for the JSON rows")
    args = ap.parse_args()
    prof = load_profile("h100-llama3-8b")
    w = generate("agentic-long", args.seed, args.scale).scaled(args.time_scale)
    sessions = workload_sessions(w, Rendering(block_size=args.block_tokens))[: args.sessions]
    rows: list[dict[str, Any]] = []
    for name in args.specs.split(","):
        rows += run_spec(name.strip(), sessions, prof, args)
    print(markdown(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        (out / f"heterocache_policies_{stamp}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
