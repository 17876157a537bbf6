"""Simulator results for bench/history/sim.md (current table in bench/RESULTS.md): every policy
at 64 and 1,000 workers on the agentic generator and the Mooncake trace (scaled), plus the
100k-session scale run.

    .venv/bin/python -m bench.sim.run [--quick] [--out bench/results/sim]

Writes one Markdown file with the command, machine, date and a table per configuration.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

from loadgen.sim.cli import main_rows, markdown_table

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_synthetic_trace.jsonl"
ALL = "ownerserve,static-pd,colocated,round-robin,prefix-multi-owner,least-loaded,oracle"


def configs(quick: bool, trace: Path) -> list[tuple[str, list[str]]]:
    scale = 0.2 if quick else 1.0
    return [
        (
            "64 workers, agentic generator",
            ["--workers", "64", "--sessions", str(int(4000 * scale)), "--policies", ALL],
        ),
        (
            "64 workers, Mooncake trace (time ×0.1, i.e. 10× the arrival rate)",
            [
                "--workers",
                "64",
                "--workload",
                f"trace:{trace}",
                "--time-scale",
                "0.1",
                "--sessions",
                "4000",
                "--policies",
                ALL,
            ],
        ),
        (
            "1,000 workers, agentic generator",
            ["--workers", "1000", "--sessions", str(int(20000 * scale)), "--policies", ALL],
        ),
        (
            "1,000 workers, Mooncake trace tiled 16× (disjoint ids), time ×0.1",
            [
                "--workers",
                "1000",
                "--workload",
                f"trace:{trace}",
                "--trace-repeat",
                "16",
                "--time-scale",
                "0.1",
                "--sessions",
                "70000",
                "--policies",
                ALL,
            ],
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sessions (smoke run)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sim"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"Command: `.venv/bin/python -m bench.sim.run{' --quick' if args.quick else ''}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared VM), "
        f"Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}",
        "",
    ]
    for title, argv in configs(args.quick, args.trace):
        print(f"== {title}", flush=True)
        rows = main_rows(argv)
        ev = sum(r["events"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        lines += [
            f"### {title}",
            "",
            f"`ownerserve sim {' '.join(argv)}` — {rows[0]['sessions']} sessions, "
            f"{rows[0]['requests']} requests per policy; {ev / wall:,.0f} events/s, "
            f"{wall:.0f} s wall for all policies",
            "",
            markdown_table(rows),
            "",
        ]
        (args.out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
