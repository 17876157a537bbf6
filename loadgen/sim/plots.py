"""Per-policy bar plots of a simulation's summary rows (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRICS = (
    ("e2e_mean_s", "session E2E mean (s)"),
    ("dup_factor", "HBM duplicate factor"),
    ("network_kv_gb", "network KV traffic (GB)"),
    ("ttft_p99_s", "TTFT p99 (s)"),
)


def plot_rows(rows: list[dict[str, Any]], out: Path, prefix: str = "sim") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    names = [r["policy"] for r in rows]
    for ax, (key, title) in zip(axes, METRICS, strict=True):
        ax.bar(names, [r[key] for r in rows], color="#4c72b0")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    path = out / f"{prefix}_policies.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_rates(rows: list[dict[str, Any]], out: Path, prefix: str = "sim") -> list[Path]:
    """Goodput and mean session E2E against the arrival rate, a line per policy (a sweep's
    rows, `ownerserve sim --rates`); nothing when the rows hold one rate."""
    rates = sorted({r["rate_per_min"] for r in rows})
    if len(rates) < 2:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab20")
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        mine = sorted((r for r in rows if r["policy"] == name), key=lambda r: r["rate_per_min"])
        xs = [r["rate_per_min"] for r in mine]
        style = {"marker": "o", "label": name, "color": colors(i % 20)}
        axes[0].plot(xs, [r["goodput_per_min"] for r in mine], **style)
        axes[1].plot(xs, [r["e2e_mean_s"] for r in mine], **style)
    axes[0].set_title("goodput (sessions/min at the TTFT SLO)", fontsize=9)
    axes[1].set_title("session E2E mean (s)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("main sessions / min", fontsize=8)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = out / f"{prefix}_rates.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
