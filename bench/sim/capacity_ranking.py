"""A simulator check: does `ownerserve sim` rank the targets of a capacity sweep as the
emulated sweep (`ownerserve bench capacity`) does?

    .venv/bin/python -m bench.sim.capacity_ranking --emulated bench/results/capacity_latest.json
        [--own-only] [--results-md bench/history/sim_validation.md]

It reads the emulated sweep's points, runs the simulator on the same workload, rates, worker
count and KV sizing (every worker hybrid; HBM and CPU tier in the emulated engine's 16-token
blocks; each peer's model on the workers its binary routes to: an aggregated peer on every
worker, a P/D peer on half of them as prefill and half as decode, as the sweep starts
vllm-router's P/D mode over the hybrids, `loadgen.cluster.peer_command`) and compares, per
rate and over every (target, rate) point, the order of the targets by mean session E2E (and,
over all points, by goodput): Kendall tau-b, values within 3% of each other counted as ties
(`bench.sim.validate.NOISE_TIE`). Agreement: tau ≥ 0.6 over all points. The peers' models are
named as `bench.sim.validate_peers` names them."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.sim.validate import NOISE_TIE, kendall_tau
from bench.sim.validate_peers import SIM_PEERS
from loadgen.bench import OWN_POLICIES, machine_line
from ownerserve.cli import main as ownerserve_main

TAU_MIN = 0.6
"""Kendall tau over every (target, rate) point that counts as the same ranking."""
BLOCK_TOKENS = 16
"""The emulated engine's KV block."""

Points = Mapping[tuple[str, float], float]
"""Mean session E2E per (target, rate)."""


def sim_name(target: str) -> str:
    """The simulator's policy for an emulated sweep's target."""
    return SIM_PEERS.get(target, target)


def taus(emulated: Points, simulated: Points, tie: float = NOISE_TIE) -> dict[str, float | None]:
    """Kendall tau of the targets' E2E order, per rate (key: the rate) and over every point
    both have (key `all`); None where fewer than two points pair."""
    keys = sorted(k for k in emulated if k in simulated)
    out: dict[str, float | None] = {}
    for rate in sorted({r for _, r in keys}):
        ks = [k for k in keys if k[1] == rate]
        out[f"{rate:g}"] = (
            kendall_tau([emulated[k] for k in ks], [simulated[k] for k in ks], tie)
            if len(ks) >= 2
            else None
        )
    out["all"] = (
        kendall_tau([emulated[k] for k in keys], [simulated[k] for k in keys], tie)
        if len(keys) >= 2
        else None
    )
    return out


def emulated_points(
    points: Sequence[Mapping[str, Any]], own_only: bool, key: str = "e2e_mean_s"
) -> dict[tuple[str, float], float]:
    """(target, rate) → `key` (E2E by default) of the sweep's points that have it (E2E: that
    completed a session)."""
    return {
        (p["target"], float(p["rate"])): float(p[key])
        for p in points
        if p.get(key) is not None and (not own_only or p["target"] in OWN_POLICIES)
    }


def simulate(
    targets: Sequence[str], rates: Sequence[float], sizing: Mapping[str, Any], out: Path
) -> tuple[list[str], list[dict[str, Any]]]:
    """Run `ownerserve sim` for `targets` at `rates`: its command, and its rows as points
    named by the sweep's targets (`target`, `rate`, `e2e_mean_s`, `goodput_per_min`)."""
    policies = list(dict.fromkeys(sim_name(t) for t in targets))
    back = {sim_name(t): t for t in targets}
    cmd = [
        "sim",
        "--workers", str(sizing["workers"]), "--split", "0:0:1", "--peer-cluster", "native",
        "--workload", str(sizing["workload"]), "--scale", f"{sizing['scale']:g}",
        "--sessions", str(sizing["sessions"]), "--seed", str(sizing["seed"]),
        "--time-scale", f"{sizing['time_scale']:g}",
        "--rates", ",".join(f"{r:g}" for r in rates),
        "--block-tokens", str(BLOCK_TOKENS), "--hbm-gb", f"{sizing['hbm_gb']:.6g}",
        "--cpu-blocks", str(sizing["cpu_blocks"]), "--slo-ttft-p90-s", "2",
        "--policies", ",".join(policies), "--out", str(out),
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        if ownerserve_main(cmd) != 0:
            raise RuntimeError(f"ownerserve {' '.join(cmd)} failed")
    rows = json.loads((out / "sim.json").read_text())["rows"]
    points = [
        {
            "target": back[r["policy"]],
            "rate": r["rate_per_min"],
            "e2e_mean_s": r.get("e2e_mean_s"),
            "goodput_per_min": r.get("goodput_per_min"),
        }
        for r in rows
        if r["policy"] in back
    ]
    return cmd, points


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulated", type=Path, required=True, help="a capacity sweep's JSON")
    ap.add_argument("--workers", type=int, default=4, help="the sweep's workers (all hybrid)")
    ap.add_argument("--workload", default="agentic-long")
    ap.add_argument("--scale", type=float, default=0.05, help="the sweep's --scale")
    ap.add_argument("--sessions", type=int, default=12, help="the sweep's --sessions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=0.005, help="the sweep's --time-scale")
    ap.add_argument("--num-blocks", type=int, default=559, help="the sweep's HBM blocks/worker")
    ap.add_argument("--cpu-num-blocks", type=int, default=559, help="its CPU-tier blocks/worker")
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072, help="of its profile")
    ap.add_argument("--own-only", action="store_true", help="ownerserve and its baselines only")
    ap.add_argument("--results-md", type=Path, default=None, help="append the table here")
    args = ap.parse_args(argv)
    sweep = json.loads(args.emulated.read_text())
    emulated = emulated_points(sweep, args.own_only)
    if not emulated:
        print(f"{args.emulated}: no point with a completed session", file=sys.stderr)
        return 1
    targets = list(dict.fromkeys(t for t, _ in emulated))
    rates = sorted({r for _, r in emulated})
    sizing = {
        "workers": args.workers,
        "workload": args.workload,
        "scale": args.scale,
        "sessions": args.sessions,
        "seed": args.seed,
        "time_scale": args.time_scale,
        "hbm_gb": args.num_blocks * BLOCK_TOKENS * args.kv_bytes_per_token / 1e9,
        "cpu_blocks": args.cpu_num_blocks,
    }
    with tempfile.TemporaryDirectory(prefix="capacity-ranking-") as tmp:
        cmd, sim_rows = simulate(targets, rates, sizing, Path(tmp))
    simulated = emulated_points(sim_rows, args.own_only)
    result = taus(emulated, simulated)
    by_goodput = taus(
        emulated_points(sweep, args.own_only, "goodput_per_min"),
        emulated_points(sim_rows, args.own_only, "goodput_per_min"),
    )["all"]
    lines = [
        f"Command: `.venv/bin/python -m bench.sim.capacity_ranking "
        f"{' '.join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}`  ",
        f"Date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; machine: "
        f"{machine_line()}  ",
        f"Simulator: `ownerserve {' '.join(shlex.quote(c) for c in cmd)}`",
        "",
        "| target | " + " | ".join(f"{r:g}/min emulated / sim E2E s" for r in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for t in targets:
        cells = []
        for r in rates:
            e, s = emulated.get((t, r)), simulated.get((t, r))
            cells.append(f"{'–' if e is None else f'{e:.2f}'} / {'–' if s is None else f'{s:.2f}'}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("")
    per_rate = ", ".join(
        f"{k}/min {'–' if v is None else f'{v:.2f}'}" for k, v in result.items() if k != "all"
    )
    tau = result["all"]
    verdict = "met" if tau is not None and tau >= TAU_MIN else "not met"
    lines.append(
        f"Kendall tau of the E2E order (ties within {NOISE_TIE:.0%}): all points "
        f"{'–' if tau is None else f'{tau:.2f}'} (≥ {TAU_MIN}: {verdict}); per rate: {per_rate}. "
        "By goodput, all points: "
        f"{'– (all tied)' if by_goodput is None else f'{by_goodput:.2f}'}. A sweep's E2E is "
        "the mean of the sessions that completed within the point's time limit: where a "
        "target completes few, read the goodput's order."
    )
    text = "\n".join(lines)
    print(text)
    if args.results_md is not None:
        with args.results_md.open("a") as f:
            f.write(f"\n### Capacity sweep ranking, simulator against emulated\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
