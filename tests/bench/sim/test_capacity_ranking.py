"""The capacity sweep's ranking check (`bench.sim.capacity_ranking`): which points pair, and
the per-rate and overall Kendall tau of the targets' E2E order."""

from __future__ import annotations

import pytest

from bench.sim.capacity_ranking import emulated_points, sim_name, taus


def test_taus_pair_the_points_both_have_per_rate_and_over_all() -> None:
    emulated = {("a", 15.0): 1.0, ("b", 15.0): 2.0, ("c", 15.0): 3.0, ("a", 60.0): 5.0,
                ("b", 60.0): 4.0, ("only-emulated", 60.0): 9.0}  # fmt: skip
    same = {k: v * 2 for k, v in emulated.items() if k[0] != "only-emulated"}
    out = taus(emulated, same)
    assert out["15"] == pytest.approx(1.0) and out["60"] == pytest.approx(1.0)
    assert out["all"] == pytest.approx(1.0)
    reversed_ = {k: -v for k, v in same.items()}
    assert taus(emulated, reversed_)["all"] == pytest.approx(-1.0)
    lone = taus({("a", 15.0): 1.0}, {("a", 15.0): 1.0})
    assert lone == {"15": None, "all": None}


def test_emulated_points_skip_points_without_a_completed_session_and_peers_when_asked() -> None:
    points = [
        {"target": "ownerserve", "rate": 15, "e2e_mean_s": 7.5},
        {"target": "colocated", "rate": 15, "e2e_mean_s": None},
        {"target": "vllm-router cache_aware", "rate": 15, "e2e_mean_s": 8.0},
    ]
    assert emulated_points(points, own_only=False) == {
        ("ownerserve", 15.0): 7.5,
        ("vllm-router cache_aware", 15.0): 8.0,
    }
    assert emulated_points(points, own_only=True) == {("ownerserve", 15.0): 7.5}
    assert sim_name("vllm-router cache_aware") == "vllm-cache-aware"
    assert sim_name("ownerserve") == "ownerserve"
