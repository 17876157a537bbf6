"""`bench.directory.sweep` runs end to end (a smoke test, not a measurement): on a small
directory both backends drop exactly the expired half's records."""

from __future__ import annotations

from tests.bench import run_bench


def test_the_sweep_bench_drops_the_expired_half_on_both_backends() -> None:
    out = run_bench("bench.directory.sweep", ["--sessions", "40", "--blocks", "8"], 120)
    rows = {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if line.startswith(("| memory", "| redis"))
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    # 20 expired sessions: 4 artifacts and a 2-block replica each
    dropped = {rows[k][0] for k in ("memory", "redis, by expiry hints", "redis, full scan")}
    assert dropped == {str(20 * (4 + 2))}, out
