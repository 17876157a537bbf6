"""The simulator validation's verdict logic: rank agreement with noise ties, relative gaps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.validate import PolicyRow, judge, kendall_tau, main, rel_gap, section


def test_kendall_tau_orders() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    # 10.0 and 10.2 are within 3%: a tie on the first side, not a discordant pair
    assert kendall_tau([10.0, 10.2, 20.0], [11.0, 10.0, 30.0], tie=0.03) == pytest.approx(
        2 / (2 * 3) ** 0.5
    )
    assert kendall_tau([1.0, 1.0], [2.0, 2.0]) is None
    with pytest.raises(ValueError):
        kendall_tau([1], [1, 2])


def test_rel_gap() -> None:
    assert rel_gap(12.0, 10.0) == pytest.approx(0.2)
    assert rel_gap(0, 0) == 0.0 and rel_gap(1, 0) is None and rel_gap(None, 1) is None


def _row(name: str, e2e: tuple[float, float], kv: tuple[int, int]) -> PolicyRow:
    keys = ("e2e_mean_s", "prefill_tokens", "kv_bytes", "dup_factor")
    emu = dict(zip(keys, (e2e[0], 100, kv[0], 2.0), strict=True))
    sim = dict(zip(keys, (e2e[1], 110, kv[1], 2.1), strict=True))
    return PolicyRow(name, emu, sim)


def test_judge_meets_and_misses_the_tolerance() -> None:
    good = [_row("a", (10, 11), (100, 90)), _row("b", (12, 12.5), (200, 210))]
    v = judge(good)
    assert v.e2e_rank_ok and v.e2e_values_ok and all(v.counts_ok.values())
    bad = [_row("a", (10, 14), (100, 10)), _row("b", (12, 12.5), (200, 210))]
    v = judge(bad)
    assert not v.e2e_rank_ok and not v.e2e_values_ok and not v.counts_ok["kv_bytes"]
    assert v.max_gaps["kv_bytes"] == pytest.approx(0.9)


def test_section_renders_saved_runs(tmp_path: Path) -> None:
    rows = [_row("ownerserve", (14, 12), (10, 11)), _row("static-pd", (13, 13.2), (50, 52))]
    rows.append(_row("colocated", (14, 13.9), (0, 0)))
    run = {
        "meta": {
            "command": "python -m bench.sim.validate",
            "date": "2026-11-22T12:00:00+00:00",
            "machine": "test",
            "wall_s": 60.0,
            "speed": 1.0,
            "timing_fidelity": [0.99, 1.0],
            "workload": {"sessions": 2, "rate_per_s": 1.0, "seed": 0, "requests": 5},
        },
        "rows": [
            {"policy": r.policy, "emulated": r.emulated, "simulated": r.simulated} for r in rows
        ],
    }
    text = section([run], "notes here")
    assert text.startswith("## Simulator validation\n")
    assert "| ownerserve | 14.00 / 12.00 (-14%)" in text
    assert "baselines only" in text and text.rstrip().endswith("notes here")
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run))
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    assert main(["--section", str(saved), "--results-md", str(md), "--notes", "/nonexistent"]) == 0
    out = md.read_text()
    assert "## Other\n\nkept" in out and "## Simulator validation\n" in out
