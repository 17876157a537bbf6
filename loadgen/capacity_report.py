"""The capacity search's report, the same for the emulated cluster and the simulator: per target
its capacity at each SLO (best shape, how the search ended), the ratio to the best peer, what
the run at that capacity moved and computed; the JSON rows (`capacity_latest.json`'s point keys
plus each target's `capacity_per_min`), and the Kendall tau between two rankings."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.capacity_search import (
    SLO,
    Observation,
    TargetCapacity,
    attainment,
    capacity_ranking_tau,
)

PointRow = Callable[[Observation], dict[str, Any]]
"""An observation's own numbers as a JSON row (`target`, `rate`, `goodput_per_min`, ...)."""


def capacities(targets: Sequence[TargetCapacity], slo: str) -> dict[str, float]:
    return {t.target: t.capacity(slo) for t in targets}


def rows(
    targets: Sequence[TargetCapacity], slos: Sequence[SLO], point_row: PointRow
) -> list[dict[str, Any]]:
    """Every run of every shape as one row: the point's numbers, its shape, the share of
    sessions meeting each SLO, whether it was discarded; and its target's capacity at each SLO
    (`capacity_per_min`: at the first, the tight one) with the best shape."""
    out = []
    for t in targets:
        by_slo = {s.name: t.capacity(s.name) for s in slos}
        best = {s.name: t.best(s.name).split for s in slos}
        for shape in t.shapes:
            for rate, obs in shape.runs.items():
                row = point_row(obs)
                row.update(
                    target=t.target,
                    rate=rate,
                    split=shape.split,
                    attainment={s.name: attainment(obs, s) for s in slos},
                    discarded=obs.discarded,
                    capacity_per_min=by_slo[slos[0].name],
                    capacity_per_min_by_slo=by_slo,
                    best_split=best,
                    status={s.name: shape.results[s.name].status for s in slos},
                )
                out.append(row)
    return out


def _at_capacity(t: TargetCapacity, slo: str) -> Observation | None:
    shape = t.best(slo)
    cap = shape.results[slo].capacity_per_min
    return shape.runs.get(cap)


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def capacity_table(
    targets: Sequence[TargetCapacity],
    slos: Sequence[SLO],
    peers: Sequence[str],
    point_row: PointRow,
) -> str:
    """One row per target: capacity per SLO (its best shape, how the search ended) and the
    ratio to the best peer's; at the last (loosest) SLO's capacity, where a target that never
    meets the tight one still has a point, KV moved, HBM duplicates and prefill computed
    against the ideal."""
    best_peer = {
        s.name: max((t.capacity(s.name) for t in targets if t.target in peers), default=0.0)
        for s in slos
    }
    head = "| target |"
    for s in slos:
        head += f" {s.name}: capacity /min (shape, search) | × best peer |"
    at = slos[-1].name
    head += f" at {at} capacity: KV moved MB | HBM dup | prefill computed / ideal |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for t in targets:
        cells = []
        for s in slos:
            shape = t.best(s.name)
            res = shape.results[s.name]
            ratio = res.capacity_per_min / best_peer[s.name] if best_peer[s.name] else None
            noisy = "" if res.monotone else ", not monotone"
            cells.append(f"{res.capacity_per_min:,.0f} ({shape.split}, {res.status}{noisy})")
            cells.append(_f(ratio))
        obs = _at_capacity(t, at)
        row = point_row(obs) if obs is not None else {}
        moved = row.get("kv_bytes_moved")
        computed, ideal = row.get("prefill_tokens_computed"), row.get("prefill_tokens_ideal")
        cells.append(_f(moved / 1e6 if moved is not None else None, "{:,.0f}"))
        cells.append(_f(row.get("duplicate_factor")))
        ratio = computed / ideal if computed is not None and ideal else None
        cells.append(
            f"{_f(computed, '{:,.0f}')} / {_f(ideal, '{:,.0f}')} (×{_f(ratio)})" if row else "–"
        )
        lines.append(f"| {t.target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_table(targets: Sequence[TargetCapacity], slos: Sequence[SLO]) -> str:
    """Every run the searches took: target, shape, rate, share of sessions meeting each SLO."""
    head = "| target | shape | rate /min | " + " | ".join(f"{s.name} met" for s in slos) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for t in targets:
        for shape in t.shapes:
            for rate, obs in shape.runs.items():
                met = " | ".join(f"{attainment(obs, s):.0%}" for s in slos)
                note = f" (discarded: {obs.discarded})" if obs.discarded else ""
                lines.append(f"| {t.target} | {shape.split} | {rate:,.0f}{note} | {met} |")
    return "\n".join(lines)


def ranking_tau(
    ours: Sequence[TargetCapacity], other_rows: Sequence[Mapping[str, Any]], slo: str
) -> tuple[float | None, int]:
    """Kendall tau of our targets' capacities at `slo` against another report's rows
    (`capacity_per_min_by_slo` per target), and how many targets both have."""
    theirs: dict[str, float] = {}
    for r in other_rows:
        by = r.get("capacity_per_min_by_slo")
        if isinstance(by, Mapping) and slo in by and "target" in r:
            theirs[str(r["target"])] = float(by[slo])
    mine = capacities(ours, slo)
    return capacity_ranking_tau(mine, theirs), len(set(mine) & set(theirs))


def write_json(path: Path, data: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def write_plot(targets: Sequence[TargetCapacity], slos: Sequence[SLO], path: Path) -> Path:
    """Attainment against rate per target at its best shape for each SLO (PNG)."""
    from loadgen.plots import plot_attainment  # matplotlib: only when writing

    curves = []
    for t in targets:
        for s in slos:
            shape = t.best(s.name)
            pts = [
                (rate, attainment(obs, s))
                for rate, obs in shape.runs.items()
                if obs.discarded is None
            ]
            curves.append((f"{t.target}|{s.name}", pts))
    return plot_attainment(curves, [s.name for s in slos], path)
