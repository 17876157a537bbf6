"""Does ownerserve's default hold on traffic it was not tuned for? Every workload family at
every load up to overload, against the best peer router model at that point.

    .venv/bin/python -m bench.sim.generalization [--families trace,agentic,...] [--own ...]
        [--peers-cache FILE] [--out bench/results/sim_generalization]

Per (family, load): every peer model in its own deployment shape (`ownerserve sim
--peer-cluster native`), then ownerserve as configured by `--own` (each `NAME=ARGS` runs
`ownerserve sim ARGS --policies ownerserve` and is reported as NAME; default: the default
deployment, 1:1:1 and 64 hybrids). The peers do not depend on the planner, so their rows are
kept in `--peers-cache` (keyed by the point's arguments) and run once. 64 workers; the
families and loads (`FAMILIES`):

- `trace`: the Mooncake FAST'25 synthetic trace (`data/mooncake_synthetic_trace.jsonl`), its
  first 2,000 requests (511 s), at 1×, 5×, 10×, 20×, 40× its recorded rate (`--time-scale
  1/load`).
- `agentic`: the simulator's coding-agent generator, 400 sessions at load × 0.64/s, loads 1, 8.
- `agentic-long`: the capacity bench's scale under KV pressure (`--scale 0.05 --time-scale
  0.005 --block-tokens 64`, 2.64 GB HBM + 315 CPU blocks per worker), 150 main sessions at
  7,680 and 30,720 per minute.
- `docqa`, `forked`, `resume`, `mixed`: the load generator's workloads (`--scale 10`), their
  arrivals and gaps compressed by the load (`--time-scale 1/load`), loads 1 and 16.

Sizes are small so that the whole grid runs in well under an hour on a shared 2-core VM.

The best peer at a point has the largest good share (sessions completed with p90 step TTFT ≤
2 s), ties within 0.5 points going to the lower mean session E2E (`bench.sim.peers_sweep`'s
rule). Reported per own configuration: goodput ratio (good shares), mean E2E ratio, HBM
duplicate factor and KV moved over the network, beside the best peer's."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.peers_sweep import TRACE, best_peer, good_share
from loadgen.bench import machine_line
from loadgen.sim.cli import main_rows
from planner.policies.peers import PEERS

Row = dict[str, Any]

_AGENTIC_LONG = [
    "--workload", "agentic-long", "--scale", "0.05", "--time-scale", "0.005",
    "--sessions", "150", "--block-tokens", "64", "--hbm-gb", "2.64241152",
    "--cpu-blocks", "315",
]  # fmt: skip


def _loadgen(name: str) -> list[tuple[str, list[str]]]:
    return [
        (f"×{k}", ["--workload", name, "--scale", "10", "--time-scale", f"{1 / k:g}"])
        for k in (1, 16)
    ]


FAMILIES: dict[str, list[tuple[str, list[str]]]] = {
    "trace": [
        (
            f"{k}×",
            ["--workload", f"trace:{TRACE}", "--time-scale", f"{1 / k:g}", "--sessions", "2000"],
        )
        for k in (1, 5, 10, 20, 40)
    ],
    "agentic": [(f"×{k}", ["--sessions", "400", "--rate", f"{0.64 * k:g}"]) for k in (1, 8)],
    "agentic-long": [(f"{r}/min", [*_AGENTIC_LONG, "--rates", str(r)]) for r in (7680, 30720)],
    "docqa": _loadgen("docqa"),
    "forked": _loadgen("forked"),
    "resume": _loadgen("resume"),
    "mixed": _loadgen("mixed"),
}
"""Per family, its loads: (label, `ownerserve sim` arguments without workers and policies)."""

DEFAULT_OWN = ("default=", "1:1:1=--split 1:1:1", "hybrids=--split 0:0:1")
DEFAULT_PEERS = (
    "llm-d", "llm-d-pd", "dynamo-kv", "sglang-cache-aware", "vllm-consistent-hash", "thunderagent",
)  # fmt: skip
"""The peers that were the best at some point of an earlier sweep (`bench/history/sim.md`);
`--peers all` runs every peer model."""


def _sim(argv: Sequence[str]) -> list[Row]:
    with contextlib.redirect_stdout(io.StringIO()):
        return main_rows(list(argv))


def run(
    families: Sequence[str],
    own: Sequence[tuple[str, list[str]]],
    cache: Path,
    workers: int,
    peers_run: Sequence[str],
) -> list[Row]:
    """Every point's peer rows (from `cache` when there) and own rows, labelled."""
    peers: dict[str, list[Row]] = json.loads(cache.read_text()) if cache.exists() else {}
    rows: list[Row] = []
    for family in families:
        for label, point in FAMILIES[family]:
            argv = ["--workers", str(workers), *point]
            key = shlex.join(argv)
            t0 = time.perf_counter()
            if key not in peers:
                peers[key] = _sim([*argv, "--policies", ",".join(peers_run)])
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(peers, indent=1, default=str))
            got = [dict(r) for r in peers[key]]
            for name, extra in own:
                for r in _sim([*argv, *extra, "--policies", "ownerserve"]):
                    r["policy"] = f"ownerserve ({name})"
                    got.append(r)
            for r in got:
                r.update(family=family, load=label, argv=key)
            rows += got
            # what is done so far, should the run be cut short
            partial = cache.with_name(cache.stem + ".rows.json")
            partial.write_text(json.dumps(rows, indent=1, default=str))
            best = best_peer(got)
            print(
                f"{family} {label}: best peer {best['policy'] if best else '-'} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return rows


def table(rows: Sequence[Row], own: Sequence[str]) -> str:
    """Per point: the best peer (good %, E2E, dup, KV GB) and each own configuration's goodput
    ratio / E2E ratio / dup / KV GB."""
    head = "| family | load | best peer: good % / E2E s / dup / KV GB | " + " | ".join(
        f"{n}: goodput× / E2E× / dup / KV GB" for n in own
    )
    lines = [head + " |", "| --- | --- | --- |" + " ---: |" * len(own)]
    points = dict.fromkeys((r["family"], r["load"]) for r in rows)
    for family, load in points:
        at = [r for r in rows if r["family"] == family and r["load"] == load]
        best = best_peer(at)
        if best is None:
            continue
        b, e = good_share(best), best["e2e_mean_s"]
        cells = [
            f"{best['policy']}: {100 * b:.1f} / {e:.2f} / {best['dup_factor']:.2f} / "
            f"{best['network_kv_gb']:.0f}"
        ]
        for n in own:
            mine = next((r for r in at if r["policy"] == f"ownerserve ({n})"), None)
            if mine is None:
                cells.append("–")
                continue
            g = good_share(mine) / b if b else float("nan")
            cells.append(
                f"{g:.2f} / {mine['e2e_mean_s'] / e if e else float('nan'):.2f} / "
                f"{mine['dup_factor']:.2f} / {mine['network_kv_gb']:.0f}"
            )
        lines.append(f"| {family} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.generalization", description=__doc__)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma list of FAMILIES")
    ap.add_argument(
        "--own",
        nargs="+",
        default=list(DEFAULT_OWN),
        help="own configurations, each NAME=ARGS (extra `ownerserve sim` arguments)",
    )
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument(
        "--peers", default=",".join(DEFAULT_PEERS), help="comma list of peer models, or 'all'"
    )
    ap.add_argument(
        "--peers-cache", type=Path, default=Path("bench/results/sim_generalization/peers.json")
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/sim_generalization"))
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(
            f"generalization: unknown families {unknown}; choose from {list(FAMILIES)}"
        )
    own = []
    for spec in args.own:
        name, sep, extra = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"generalization: --own {spec!r}: NAME=ARGS")
        own.append((name, shlex.split(extra)))
    started = dt.datetime.now(dt.UTC)
    peers_run = list(PEERS) if args.peers == "all" else args.peers.split(",")
    rows = run(families, own, args.peers_cache, args.workers, peers_run)
    md = (
        f"Command: `python -m bench.sim.generalization {shlex.join(argv)}`. Machine: "
        f"{machine_line()}. Started {started:%Y-%m-%d %H:%M} UTC. Simulated times, one seed.\n\n"
        + table(rows, [n for n, _ in own])
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{started:%Y%m%dT%H%M%SZ}"
    (args.out / f"generalization_{stamp}.json").write_text(json.dumps(rows, indent=1, default=str))
    (args.out / f"generalization_{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
