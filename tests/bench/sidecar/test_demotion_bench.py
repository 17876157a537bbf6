"""`bench.sidecar.demotion` runs end to end (a smoke test, not a measurement): one row per mode,
each having demoted every artifact beyond the two the memory tier holds."""

from __future__ import annotations

from pathlib import Path

from tests.bench import run_bench


def test_the_demotion_bench_prints_both_modes(tmp_path: Path) -> None:
    argv = ["--sizes", "64K", "--puts", "5", "--rounds", "1", "--dir", str(tmp_path)]
    out = run_bench("bench.sidecar.demotion", argv, 120)
    rows = [line for line in out.splitlines() if line.startswith("| 64 KiB")]
    assert [r.split("|")[2].strip() for r in rows] == ["on the loop", "behind"], out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == "3" and all(float(c) >= 0 for c in cells[2:7]), row
    assert list(tmp_path.iterdir()) == []  # its files are removed
