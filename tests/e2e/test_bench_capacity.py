"""`ownerserve bench capacity --quick` on a two-worker cluster: every (target, rate) point lands in
`capacity_latest.json` with the fields below, and its numbers hang together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadgen.cluster import REPO_ROOT

FIELDS = {
    "target": str,
    "rate": float,
    "goodput_per_min": float,
    "e2e_mean_s": float,
    "prefill_tokens_computed": int,
    "prompt_tokens": int,
    "errors": int,
    "rejected_429": int,
}


def test_quick_sweep_writes_one_sane_point_per_target_and_rate(tmp_path: Path) -> None:
    out, history = tmp_path / "results", tmp_path / "capacity.md"
    # No CPU tier: with one, the emulator stalls requests under HBM pressure (see
    # bench/history/capacity.md); plenty of HBM keeps the light-load point inside the SLO.
    cmd = [sys.executable, "-m", "ownerserve", "bench", "capacity", "--quick", "--rates", "60,600",
           "--targets", "ownerserve,colocated", "--prefill", "1", "--decode", "1", "--hybrid", "0",
           "--num-blocks", "1500", "--cpu-num-blocks", "0", "--duration-s", "15",
           "--out-dir", str(out), "--results-md", str(history),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]

    points = json.loads((out / "capacity_latest.json").read_text())
    assert sorted((p["target"], p["rate"]) for p in points) == [
        ("colocated", 60.0),
        ("colocated", 600.0),
        ("ownerserve", 60.0),
        ("ownerserve", 600.0),
    ]
    for p in points:
        for name, kind in FIELDS.items():
            assert isinstance(p[name], kind), (name, p)
        assert 0 <= p["sessions_good"] <= p["sessions_completed"] <= p["sessions"] == 3
        assert p["goodput_per_min"] == p["rate"] * p["sessions_good"] / p["sessions"]
        assert p["errors"] == 0 and p["rejected_429"] == 0, p
        assert p["prompt_tokens"] > 0
        # the workers cannot compute less than an unbounded shared prefix cache would
        assert p["prefill_tokens_computed"] >= 0.95 * p["prefill_tokens_ideal"] > 0, p
        assert p["ttft_p50_s"] <= p["ttft_p99_s"]
    light = [p for p in points if p["rate"] == 60.0]
    assert all(p["sessions_good"] == 3 and p["goodput_per_min"] == 60.0 for p in light), light
    assert list(out.glob("capacity_*Z.json")) and (out / "capacity_latest.png").stat().st_size
    section = history.read_text()
    assert "## Capacity sweep" in section and "| ownerserve | 60.0 |" in section
    assert "ownerserve bench capacity --quick" in section and "KV sizing" in section
