"""`bench.directory.sweep` runs end to end (a smoke test, not a measurement): on a small
directory both backends drop exactly the expired half's records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_sweep_bench_drops_the_expired_half_on_both_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.directory.sweep", "--sessions", "40", "--blocks", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if line.startswith(("| memory", "| redis"))
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    # 20 expired sessions: 4 artifacts and a 2-block replica each
    dropped = {rows[k][0] for k in ("memory", "redis, by expiry hints", "redis, full scan")}
    assert dropped == {str(20 * (4 + 2))}, out
