"""PNG plots of replay runs (matplotlib, Agg backend): latency CDFs, per-run bars, and the
capacity sweep's curves against the offered rate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadgen.capacity import CapacityPoint
from loadgen.client import RunResult
from loadgen.report import RunSummary

HIGHLIGHT = "ownerserve"


def _color(i: int, label: str) -> str:
    """Black for OwnerServe's own policy, distinct tab20 colours for the rest."""
    if label == HIGHLIGHT:
        return "black"
    return str(matplotlib.colors.to_hex(plt.get_cmap("tab20")(i % 20)))


def _cdf(ax: plt.Axes, values: Sequence[float], label: str, color: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    width = 2.2 if label == HIGHLIGHT else 1.2
    ax.step(xs, ys, where="post", label=label, color=color, linewidth=width)


def plot_cdfs(results: Sequence[RunResult], path: Path) -> Path:
    """Session E2E and TTFT CDFs, one line per run."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(results):
        c = _color(i, r.label)
        _cdf(a1, [s.e2e_s for s in r.sessions if s.completed and s.e2e_s is not None], r.label, c)
        _cdf(a2, [q.ttft_s for q in r.requests if q.ok and q.ttft_s is not None], r.label, c)
    a1.set_xlabel("session E2E (s, incl. tool gaps)")
    a2.set_xlabel("TTFT (s)")
    a2.set_xscale("log")
    for ax in (a1, a2):
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_Bar = tuple[str, Callable[[RunSummary], float | None]]

BARS: tuple[_Bar, ...] = (
    ("mean session E2E (s)", lambda s: s.session_e2e.mean),
    ("TTFT p99 (s)", lambda s: s.ttft.p99),
    ("prefill tokens computed", lambda s: s.cluster.prefill_tokens_computed if s.cluster else None),
    ("KV bytes moved (GB)", lambda s: _gb(s.cluster.kv_bytes_moved) if s.cluster else None),
    ("HBM duplicate factor", lambda s: s.cluster.duplicate_factor if s.cluster else None),
)


def _gb(x: int | None) -> float | None:
    return None if x is None else x / 1e9


def plot_bars(summaries: Sequence[RunSummary], path: Path) -> Path:
    """One panel per metric that any run has, one bar per run (missing values are left out)."""
    bars = [b for b in BARS if any(b[1](s) is not None for s in summaries)] or list(BARS[:1])
    fig, axes = plt.subplots(1, len(bars), figsize=(4 * len(bars), 4.5), squeeze=False)
    labels = [s.label for s in summaries]
    for ax, (title, get) in zip(axes[0], bars, strict=True):
        vals = [get(s) for s in summaries]
        xs = [i for i, v in enumerate(vals) if v is not None]
        colors = [_color(i, labels[i]) for i in xs]
        ax.bar(xs, [vals[i] or 0.0 for i in xs], color=colors)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_runs(
    summaries: Sequence[RunSummary], results: Sequence[RunResult], out_dir: Path, stem: str
) -> dict[str, Path]:
    """`<stem>_cdf.png` and `<stem>_bars.png` in `out_dir` (those it has data for), by key
    (`cdf`, `bars`): what `loadgen.report.write_report` shows as `images`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if results:
        paths["cdf"] = plot_cdfs(results, out_dir / f"{stem}_cdf.png")
    if summaries:
        paths["bars"] = plot_bars(summaries, out_dir / f"{stem}_bars.png")
    return paths


_Curve = tuple[str, Callable[[CapacityPoint], float | None]]

CAPACITY_CURVES: tuple[_Curve, ...] = (
    ("goodput (good sessions/min)", lambda p: p.goodput_per_min),
    ("mean session E2E (s)", lambda p: p.e2e_mean_s),
    ("prefill computed / ideal", lambda p: p.recompute_ratio),
)


def plot_capacity(points: Sequence[CapacityPoint], path: Path) -> Path:
    """Goodput, session E2E and recompute against the offered rate, one line per target."""
    fig, axes = plt.subplots(1, len(CAPACITY_CURVES), figsize=(5 * len(CAPACITY_CURVES), 4.5))
    targets = list(dict.fromkeys(p.target for p in points))
    for ax, (title, get) in zip(axes, CAPACITY_CURVES, strict=True):
        for i, target in enumerate(targets):
            pts = sorted((p for p in points if p.target == target), key=lambda p: p.rate)
            xy = [(p.rate, v) for p in pts if (v := get(p)) is not None]
            if not xy:
                continue
            width = 2.2 if target == HIGHLIGHT else 1.2
            ax.plot(*zip(*xy, strict=True), marker="o", label=target, color=_color(i, target),
                    linewidth=width)  # fmt: skip
        ax.set_xlabel("offered rate (sessions/min)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attainment(
    curves: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    slos: Sequence[str],
    path: Path,
    goal: float = 0.9,
) -> Path:
    """Share of sessions meeting each SLO against the offered rate (log scale), one panel per
    SLO, one line per target at its best shape; `curves`: (label, [(rate, share)...]) for
    each target and SLO, labels `target|slo`."""
    fig, axes = plt.subplots(1, len(slos), figsize=(6 * len(slos), 4.5), squeeze=False)
    for ax, slo in zip(axes[0], slos, strict=True):
        mine = [(lab.split("|")[0], pts) for lab, pts in curves if lab.endswith(f"|{slo}")]
        for i, (target, pts) in enumerate(mine):
            xy = sorted(pts)
            if not xy:
                continue
            width = 2.2 if target == HIGHLIGHT else 1.2
            ax.plot(*zip(*xy, strict=True), marker="o", label=target, color=_color(i, target),
                    linewidth=width)  # fmt: skip
        ax.axhline(goal, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("offered rate (sessions/min)")
        ax.set_ylabel("sessions meeting the SLO")
        ax.set_title(f"SLO {slo}", fontsize=9)
        ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
