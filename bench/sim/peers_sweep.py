"""The peer routers' load sweep: every peer router's model beside ownerserve and the oracle, on the
agentic generator and the Mooncake trace, at 64 and 1,000 workers, the load raised until each
policy passes its knee.

    .venv/bin/python -m bench.sim.peers_sweep [--workers 64|1000] [--workload agentic|trace]
        [--loads 1,2,4,8] [--policies ...] [--quick] [--out bench/results/sim_peers]

Per (cluster, workload) and load, `ownerserve sim` runs every peer model (each on its own
deployment shape, `--peer-cluster native`), ownerserve and the oracle on the 1:1:1
split (`--split 1:1:1`; the simulator's default is every worker hybrid since 2026-12-02),
and ownerserve again on every-worker hybrids (the aggregated peers' shape). A load is a
multiple of the configuration's base arrival rate: the agentic generator's sessions arrive at
`--rate` = load × workers × 0.01 per second (the simulator's default is load 1); the trace is
replayed at load × 5 its recorded rate (`--time-scale` 0.2 / load). 64 workers: 4,000 sessions
of each; 1,000 workers: 5,000 agentic sessions (the peers' models weigh every worker on every
request, ~1-2 ms of wall a request here) and the first 16,000 sessions of 16 copies of the
trace overlaid (disjoint ids, all starting together: 16× its rate), the same load per worker as
at 64 over the first quarter of the trace's span.

Per point: the share of sessions good at the SLO (completed, p90 of their steps' TTFT ≤ 2 s),
mean session E2E, TTFT p99, prefill tokens computed, KV moved over the network and the HBM
duplicate factor. Some sessions cannot meet the SLO at any load (a first prompt whose prefill
alone takes over 2 s): the sweep's ceiling is the largest good share any policy reached at the
lightest load, and a policy's knee is the first load at which its good share falls below
`KNEE_GOOD` of that ceiling ("> top" when it holds at every load). The best peer at a
load has the largest good share, ties (within `TIE`) going to the lower mean E2E; ownerserve's
goodput ratio against it is the ratio of good shares (the offered load is the same), its E2E
ratio the ratio of means. Writes `peers_sweep.json` (every row) and `peers_sweep.md` (the
tables, with command, machine and date) to --out and prints the tables."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.bench import machine_line
from loadgen.sim.cli import main_rows
from planner.policies.peers import PEERS

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"
KNEE_GOOD = 0.95
"""A policy holds a load while its good share is at least this share of the sweep's ceiling."""
TIE = 0.005
"""Good shares this close count as equal when picking the best peer."""
OWN = ("ownerserve", "oracle")
HYBRIDS = "ownerserve (hybrids)"
"""ownerserve on `--split 0:0:1`: every worker prefills and decodes."""
DEFAULT_LOADS = (1.0, 2.0, 4.0, 8.0)

Row = dict[str, Any]


def base_argv(workers: int, workload: str, load: float, quick: bool, trace: Path) -> list[str]:
    """`ownerserve sim` arguments of one (cluster, workload, load) point, without policies."""
    big = workers >= 1000
    if workload == "agentic":
        sessions = 400 if quick else (5000 if big else 4000)
        return [
            "--workers", str(workers), "--sessions", str(sessions),
            "--rate", f"{load * workers * 0.01:g}",
        ]  # fmt: skip
    if workload == "trace":
        argv = ["--workers", str(workers), "--workload", f"trace:{trace}"]
        if big:
            argv += ["--trace-repeat", "16", "--trace-overlay"]
        sessions = 400 if quick else (16000 if big else 4000)
        return [*argv, "--time-scale", f"{0.2 / load:g}", "--sessions", str(sessions)]
    raise SystemExit(f"peers_sweep: unknown workload {workload!r} (agentic|trace)")


def good_share(row: Mapping[str, Any]) -> float:
    """Sessions good at the SLO over all sessions."""
    n = row["sessions"]
    return row["sessions_good"] / n if n else 0.0


def knees(rows: Sequence[Row], loads: Sequence[float]) -> dict[str, str]:
    """Per policy, the first load at which its good share fell below `KNEE_GOOD` × the
    ceiling (the largest good share at the lightest load), as text ("×4"), or "> ×8" when it
    held at every load of the sweep."""
    out: dict[str, str] = {}
    light = min(r["load"] for r in rows) if rows else 0.0
    ceiling = max((good_share(r) for r in rows if r["load"] == light), default=0.0)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = {r["load"]: r for r in rows if r["policy"] == policy}
        failed = [x for x in loads if x in mine and good_share(mine[x]) < KNEE_GOOD * ceiling]
        out[policy] = f"×{min(failed):g}" if failed else f"> ×{max(loads):g}"
    return out


def best_peer(rows: Sequence[Row]) -> Row | None:
    """Of one load's peer rows, the one with the largest good share, ties (within `TIE`) to
    the lower mean E2E; None when there is no peer row."""
    peers = [r for r in rows if r["policy"] in PEERS]
    if not peers:
        return None
    top = max(good_share(r) for r in peers)
    return min(
        (r for r in peers if good_share(r) >= top - TIE), key=lambda r: float(r["e2e_mean_s"])
    )


def ratios(rows: Sequence[Row], loads: Sequence[float]) -> list[Row]:
    """Per load: the best peer, and ownerserve's (1:1:1 and hybrids) goodput and E2E ratios
    against it."""
    out: list[Row] = []
    for load in loads:
        at = [r for r in rows if r["load"] == load]
        best = best_peer(at)
        if best is None:
            continue
        line: Row = {"load": load, "best_peer": best["policy"]}
        b = good_share(best)
        for own in ("ownerserve", HYBRIDS):
            mine = next((r for r in at if r["policy"] == own), None)
            if mine is None:
                continue
            line[own] = {
                "goodput_ratio": good_share(mine) / b if b else None,
                "e2e_ratio": mine["e2e_mean_s"] / best["e2e_mean_s"]
                if best["e2e_mean_s"]
                else None,
            }
        out.append(line)
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def tables(title: str, argv: Sequence[str], rows: Sequence[Row], loads: Sequence[float]) -> str:
    """The Markdown of one (cluster, workload) sweep."""
    kn = knees(rows, loads)
    head = "| policy | " + " | ".join(f"×{x:g}" for x in loads) + " | knee |"
    sep = "| --- | " + " | ".join("---:" for _ in loads) + " | --- |"
    lines = [
        f"### {title}",
        "",
        f"`ownerserve sim {shlex.join(argv)}` (load ×1 shown; see the module docstring for "
        "the others). Cells: good sessions % / mean session E2E s / TTFT p99 s / prefill Mtok "
        "/ KV moved GB / HBM duplicate factor.",
        "",
        head,
        sep,
    ]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells = []
        for x in loads:
            r = next((r for r in rows if r["policy"] == policy and r["load"] == x), None)
            cells.append(
                "–"
                if r is None
                else f"{100 * good_share(r):.1f} / {r['e2e_mean_s']:.2f} / {r['ttft_p99_s']:.2f} / "
                f"{r['prefill_tokens'] / 1e6:.1f} / {r['network_kv_gb']:.0f} / "
                f"{r['dup_factor']:.2f}"
            )
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {kn[policy]} |")
    lines += [
        "",
        "| load | best peer | ownerserve goodput / E2E ratio | on hybrids |",
        "| --- | --- | ---: | ---: |",
    ]
    for r in ratios(rows, loads):
        own = r.get("ownerserve", {})
        hyb = r.get(HYBRIDS, {})
        lines.append(
            f"| ×{r['load']:g} | {r['best_peer']} | "
            f"{_fmt(own.get('goodput_ratio'), '.2f')} / {_fmt(own.get('e2e_ratio'), '.2f')} | "
            f"{_fmt(hyb.get('goodput_ratio'), '.2f')} / {_fmt(hyb.get('e2e_ratio'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def run_point(argv: Sequence[str], policies: str, hybrids: bool) -> list[Row]:
    """One load: the policies on the default split, then ownerserve on hybrids."""
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        rows = main_rows([*argv, "--policies", policies, "--split", "1:1:1"])
        if hybrids:
            extra = main_rows([*argv, "--policies", "ownerserve", "--split", "0:0:1"])
            for r in extra:
                r["policy"] = HYBRIDS
            rows += extra
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.peers_sweep", description=__doc__)
    ap.add_argument("--workers", type=int, nargs="+", default=[64])
    ap.add_argument("--workload", nargs="+", default=["agentic", "trace"])
    ap.add_argument(
        "--loads",
        default=",".join(f"{x:g}" for x in DEFAULT_LOADS),
        help="load multiples, comma list (default 1,2,4,8; --quick 1,8)",
    )
    ap.add_argument(
        "--policies",
        default=",".join([*PEERS, *OWN]),
        help="the policies on the default split (default: every peer model, ownerserve, oracle)",
    )
    ap.add_argument("--no-hybrids", action="store_true", help="skip ownerserve on hybrids")
    ap.add_argument("--quick", action="store_true", help="400 sessions, loads 1 and 8")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sim_peers"))
    args = ap.parse_args(argv)
    loads = sorted({float(x) for x in ("1,8" if args.quick else args.loads).split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    rows: list[Row] = []
    md = [
        f"Command: `python -m bench.sim.peers_sweep {shlex.join(argv or [])}`. Machine: "
        f"{machine_line()}. Started {started:%Y-%m-%d %H:%M} UTC. Simulated times, one seed.",
        "",
    ]
    for workers in args.workers:
        for workload in args.workload:
            title = f"{workers} workers, {workload}"
            mine: list[Row] = []
            for load in loads:
                point = base_argv(workers, workload, load, args.quick, args.trace)
                t0 = time.perf_counter()
                got = run_point(point, args.policies, not args.no_hybrids)
                for r in got:
                    r.update(config=title, load=load, argv=point)
                    print(
                        f"{title} ×{load:g} {r['policy']:<22} good {100 * good_share(r):5.1f}% "
                        f"E2E {r['e2e_mean_s']:7.2f}s  wall {r['wall_s']:6.1f}s",
                        flush=True,
                    )
                mine += got
                print(f"{title} ×{load:g}: {time.perf_counter() - t0:.0f} s", flush=True)
                (args.out / "peers_sweep.json").write_text(
                    json.dumps([*rows, *mine], indent=1, default=str)
                )
            rows += mine
            first = base_argv(workers, workload, loads[0], args.quick, args.trace)
            md.append(tables(title, first, mine, loads))
            (args.out / "peers_sweep.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
