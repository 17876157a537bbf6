"""The peer routers' load sweep (`bench.sim.peers_sweep`): the knee against the sweep's ceiling, the
best peer at a load, ownerserve's ratios, and one real (quick) sweep through the simulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.sim.peers_sweep import HYBRIDS, base_argv, best_peer, knees, main, ratios


def row(policy: str, load: float, good: int, e2e: float, n: int = 100) -> dict[str, Any]:
    return {"policy": policy, "load": load, "sessions": n, "sessions_good": good,
            "e2e_mean_s": e2e}  # fmt: skip


def test_the_knee_is_the_first_load_below_95_percent_of_the_lightest_loads_best_share() -> None:
    rows = [
        row("llm-d", 1, 90, 10.0), row("llm-d", 2, 86, 11.0), row("llm-d", 4, 80, 14.0),
        row("ownerserve", 1, 88, 9.0), row("ownerserve", 2, 86, 9.5),
        row("ownerserve", 4, 85, 10.0),
    ]  # fmt: skip
    # ceiling 0.90: 0.855 holds, 0.85 and 0.80 do not
    assert knees(rows, [1, 2, 4]) == {"llm-d": "×4", "ownerserve": "×4"}
    rows[-1]["sessions_good"] = 86
    assert knees(rows, [1, 2, 4])["ownerserve"] == "> ×4"


def test_the_best_peer_has_the_most_good_sessions_ties_to_the_lower_e2e() -> None:
    at = [row("llm-d", 1, 90, 10.0), row("dynamo-kv", 1, 90, 9.0),
          row("vllm-consistent-hash", 1, 95, 12.0), row("ownerserve", 1, 99, 5.0)]  # fmt: skip
    best = best_peer(at)
    assert best is not None and best["policy"] == "vllm-consistent-hash"
    at[2]["sessions_good"] = 90
    best = best_peer(at)
    assert best is not None and best["policy"] == "dynamo-kv"  # a tie: the lower E2E
    assert best_peer([row("ownerserve", 1, 99, 5.0)]) is None


def test_ratios_are_ownerserves_good_share_and_mean_e2e_over_the_best_peers() -> None:
    rows = [row("llm-d", 2, 80, 10.0), row("ownerserve", 2, 96, 7.0), row(HYBRIDS, 2, 100, 6.0)]
    (r,) = ratios(rows, [2])
    assert r["best_peer"] == "llm-d"
    assert r["ownerserve"] == {"goodput_ratio": pytest.approx(1.2), "e2e_ratio": pytest.approx(0.7)}
    assert r[HYBRIDS]["goodput_ratio"] == pytest.approx(1.25)


def test_loads_scale_the_agentic_rate_and_the_traces_replay_speed() -> None:
    trace = Path("t.jsonl")
    assert base_argv(64, "agentic", 4, False, trace)[-2:] == ["--rate", "2.56"]
    argv = base_argv(1000, "trace", 2, False, trace)
    assert argv[argv.index("--time-scale") + 1] == "0.1" and "--trace-repeat" in argv
    with pytest.raises(SystemExit):
        base_argv(64, "nope", 1, False, trace)


def test_a_quick_sweep_runs_the_simulator_and_writes_every_point(tmp_path: Path) -> None:
    main(["--quick", "--workload", "trace", "--policies", "vllm-consistent-hash,ownerserve",
          "--out", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "peers_sweep.json").read_text())
    assert {(r["policy"], r["load"]) for r in rows} == {
        (p, x) for p in ("vllm-consistent-hash", "ownerserve", HYBRIDS) for x in (1.0, 8.0)
    }
    assert all(r["sessions"] > 0 and r["requests"] > 0 for r in rows)
    md = (tmp_path / "peers_sweep.md").read_text()
    assert "| vllm-consistent-hash |" in md and "| ×8 | vllm-consistent-hash |" in md
