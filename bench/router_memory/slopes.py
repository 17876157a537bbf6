"""The second-half slopes of a `bench.router_memory.live` series, per replica: RSS, the heap in
use (pymalloc's allocated blocks + glibc malloc's in use), what the allocators hold (pymalloc's
arenas + malloc's held), malloc's free-but-kept bytes, and the directory's local mirror (its
cached (block, worker) pairs) and the workers' distinct GPU blocks, as a markdown table.

    .venv/bin/python -m bench.router_memory.slopes bench/results/router_memory_live_T.jsonl

The slope is `loadgen.chaos.schedule.slope_per_min` (least squares), over the samples at or
after `--from-s` (default: half the series' span), as the chaos report computes RSS's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadgen.chaos.schedule import slope_per_min

Row = dict[str, Any]


def _heap(r: Row) -> float:
    return float(r["pymalloc"]["in_use_mb"] + r["malloc"]["in_use_mb"])


def _held(r: Row) -> float:
    return float(r["pymalloc"]["arenas"] + r["malloc"]["held_mb"])


def _free_kept(r: Row) -> float:
    return float(r["malloc"]["free_held_mb"])


def _mirror(r: Row) -> float:
    return float(r.get("directory", {}).get("mirror_cached_pairs", float("nan")))


def _distinct(r: Row) -> float:
    return float(r.get("kv_gpu_blocks", {}).get("blocks_distinct", float("nan")))


SERIES: dict[str, Callable[[Row], float]] = {
    "RSS MB": lambda r: float(r["rss_mb"]),
    "heap in use MB": _heap,
    "allocators hold MB": _held,
    "malloc free kept MB": _free_kept,
    "mirror pairs": _mirror,
    "workers' distinct blocks": _distinct,
}


def table(rows: list[Row], from_s: float | None) -> list[str]:
    ok = [r for r in rows if "rss_mb" in r and "pymalloc" in r and "in_use_mb" in r["pymalloc"]]
    span = max(r["t_s"] for r in ok)
    start = span / 2 if from_s is None else from_s
    out = [
        f"samples from {start:.0f} s (of {span:.0f} s) on",
        "",
        "| replica | series | first → last | min-max from then | slope /min from then |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in sorted({r["replica"] for r in ok}):
        mine = [r for r in ok if r["replica"] == name]
        half = [r for r in mine if r["t_s"] >= start]
        for label, get in SERIES.items():
            values = [get(r) for r in half]
            slope = slope_per_min([(r["t_s"], get(r)) for r in half])
            out.append(
                f"| {name} | {label} | {get(mine[0]):.1f} → {get(mine[-1]):.1f} | "
                f"{min(values):.1f}-{max(values):.1f} | "
                f"{'-' if slope is None else f'{slope:+.2f}'} |"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("series", type=Path)
    ap.add_argument("--from-s", type=float, default=None)
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.series.read_text().splitlines() if line.strip()]
    print("\n".join(table(rows, args.from_s)))


if __name__ == "__main__":
    main()
