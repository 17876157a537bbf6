"""`bench.directory.steps` runs end to end (a smoke test, not a measurement): on a chain of a
few steps' blocks each operation takes several script calls."""

from __future__ import annotations

from ownerserve.directory.redis import STEP_ENTRIES
from tests.bench import run_bench


def test_the_steps_bench_reports_several_calls_for_each_operation() -> None:
    n = 3 * STEP_ENTRIES
    out = run_bench("bench.directory.steps", ["--blocks", str(n)], 120)
    rows = {
        cells[0]: cells[1:]
        for line in out.splitlines()
        if line.startswith(("| add_replica", "| gap"))
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {"add_replica", "gap drops the view"}, out
    for blocks, calls, *_ in rows.values():
        assert blocks == str(n) and int(calls) >= 3, out
