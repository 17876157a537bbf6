"""`bench.sidecar.transfer` runs end to end (a smoke test, not a measurement): a few repeats of
two small rows against a real owner process print one table row each, and over Mooncake the
sidecar's fetches come one-sided (the direct path the bench is there to measure)."""

from __future__ import annotations

from tests.bench import run_bench
from workers.sidecar import mooncake_transport as mt


def test_the_transfer_bench_prints_a_row_per_size() -> None:
    argv = ["--repeats", "5", "--rows", "4096x1,65536x4"]
    out = run_bench("bench.sidecar.transfer", argv, 240)
    rows = [line for line in out.splitlines() if line.startswith("| 4 KiB") or "x 64 KiB" in line]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 14, row
        tcp, raw_tcp = float(cells[8]), float(cells[9])
        assert tcp > 0 and raw_tcp > 0
        if mt.AVAILABLE:
            mooncake, raw = float(cells[1]), float(cells[2])
            assert mooncake > 0 and raw > 0
            # one-sided once the owner's catalog has arrived (a slow box may see it a round late)
            assert float(cells[13]) >= 0.6, row
