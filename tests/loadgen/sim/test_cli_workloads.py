"""`ownerserve sim --workload NAME`: the load generator's workloads, block for block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.sim.cli import LOADGEN_WORKLOADS, main_rows
from loadgen.workloads import generate


def test_sim_runs_the_load_generators_agentic_long_sessions() -> None:
    assert "agentic-long" in LOADGEN_WORKLOADS and "agentic" not in LOADGEN_WORKLOADS
    argv = ["--workers", "3", "--workload", "agentic-long", "--scale", "0.05"]
    (row,) = main_rows([*argv, "--time-scale", "0.01", "--policies", "round-robin"])
    assert row["requests"] == generate("agentic-long", 0, 0.05).n_requests
    (cut,) = main_rows([*argv, "--sessions", "5", "--policies", "round-robin"])
    assert 5 * 20 <= cut["requests"] < row["requests"]


def test_sim_rejects_an_unknown_workload() -> None:
    with pytest.raises(SystemExit, match="unknown workload"):
        main_rows(["--workload", "nope"])


def test_trace_copies_follow_one_another_or_overlay_at_n_times_the_rate(tmp_path: Path) -> None:
    from loadgen.sim.workload import trace_sessions

    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 64, "output_length": 4, "hash_ids": [t, t + 1]}
            for t in (0, 1000, 3000)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    tiled = trace_sessions(trace, repeat=2)
    assert [s.start_s for s in tiled] == [0.0, 1.0, 3.0, 4.0, 5.0, 7.0]  # span 3 s + 1 s
    over = trace_sessions(trace, repeat=2, overlay=True)
    assert [s.start_s for s in over] == [0.0, 0.0, 1.0, 1.0, 3.0, 3.0]
    # disjoint ids either way: no copy shares a block with another
    assert len({t.chain for s in over for t in s.turns}) == 6
    (row,) = main_rows(["--workers", "2", "--workload", f"trace:{trace}", "--trace-repeat", "2",
                        "--trace-overlay", "--policies", "round-robin"])  # fmt: skip
    assert row["sessions"] == 6
