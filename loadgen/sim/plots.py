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
