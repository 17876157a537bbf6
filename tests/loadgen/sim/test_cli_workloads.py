"""`ownerserve sim --workload NAME`: the load generator's workloads, block for block."""

from __future__ import annotations

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
