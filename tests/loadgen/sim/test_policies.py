"""The simulator with the planner's real policies: the design's expectations on a small cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadgen.sim.cli import main_rows
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import agentic_sessions
from ownerserve.profiles import load_profile
from planner.policies import get_policy

PROFILE = load_profile("h100-llama3-8b")


def _run(policy: str, oracle: bool = False) -> dict[str, Any]:
    sessions = agentic_sessions(150, 0.15, seed=1)
    sim = Simulator(ClusterSpec.of_size(12), PROFILE, get_policy(policy), oracle=oracle)
    return sim.run(sessions).summary()


def test_ownerserve_moves_less_kv_and_duplicates_less_than_static_pd() -> None:
    own, pd = _run("ownerserve"), _run("static-pd")
    assert own["requests"] == pd["requests"] > 150
    assert own["network_kv_gb"] < 0.5 * pd["network_kv_gb"]
    assert own["dup_factor"] < pd["dup_factor"]
    assert own["e2e_mean_s"] <= pd["e2e_mean_s"] * 1.05


def test_colocated_moves_no_kv_and_static_pd_never_colocates() -> None:
    col, pd = _run("colocated"), _run("static-pd")
    assert col["network_kv_gb"] == 0.0 and set(col["actions"]) == {"colocated_prefill"}
    assert set(pd["actions"]) == {"remote_prefill"} and pd["decode_interference_s"] == 0.0


def test_cli_writes_json_and_plots(tmp_path: Path) -> None:
    rows = main_rows(
        [
            "--workers",
            "9",
            "--sessions",
            "40",
            "--policies",
            "ownerserve,round-robin,oracle",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["policy"] for r in rows] == ["ownerserve", "round-robin", "oracle"]
    data = json.loads((tmp_path / "sim.json").read_text())
    assert len(data["rows"]) == 3 and (tmp_path / "sim_policies.png").stat().st_size > 1000


def test_load_scrape_flag_reaches_the_policies_view() -> None:
    """A stale kv_usage (scraped every 5 s) changes ownerserve's choices; 0 is always current."""
    argv = ["--workers", "6", "--sessions", "40", "--rate", "2", "--policies", "ownerserve"]
    fresh = main_rows([*argv, "--load-scrape-s", "0"])[0]
    stale = main_rows([*argv, "--load-scrape-s", "5"])[0]
    assert fresh["e2e_mean_s"] != stale["e2e_mean_s"]
    with pytest.raises(SystemExit, match="load-scrape-s"):
        main_rows([*argv, "--load-scrape-s", "-1"])
