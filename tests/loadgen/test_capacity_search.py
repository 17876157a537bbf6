"""The capacity search over synthetic deterministic systems: SLO checks per request and per
session, bracket growth and shrink, bisection to the tolerance, a target that never meets the
SLO, one that meets it up to the cap, noise, discarded runs, run reuse across SLOs, and the
ranking's Kendall tau."""

from __future__ import annotations

import random

import pytest

from loadgen.capacity_search import (
    LOOSE,
    SLO,
    TIGHT,
    Observation,
    RequestSample,
    SearchSettings,
    SessionSample,
    attainment,
    capacity_ranking_tau,
    kendall_tau,
    search_capacity,
    search_target,
    unloaded_tpot_s,
    unloaded_ttft_s,
)
from ownerserve.profiles import load_profile

SLO_1 = SLO("x", ttft_factor=2.0, tpot_factor=2.0)
SETTINGS = SearchSettings(start_rate=10.0, max_rate=1_000.0, min_rate=1.0)


def system(knee: float, sessions: int = 20):
    """A deterministic system: session i (of `sessions`) keeps its requests within 2× their
    unloaded latencies while the rate is below `knee × (1 + i / sessions)`: the share meeting
    the SLO falls from 1 to 0 between `knee` and 2 × `knee`."""
    calls: list[float] = []

    def run(rate: float) -> Observation:
        calls.append(rate)
        out = []
        for i in range(sessions):
            good = rate <= knee * (1 + i / sessions)
            ttft = 0.1 if good else 0.5
            out.append(SessionSample(True, (RequestSample(ttft, 0.01, 0.1, 0.01),) * 4))
        return Observation(rate, tuple(out))

    return run, calls


def sustained(knee: float, sessions: int = 20, share: float = 0.9) -> float:
    """The highest rate with `share` of the sessions good: the rate where 10% fail."""
    return knee * (1 + (sessions - round(share * sessions)) / sessions)


def test_a_request_meets_the_slo_within_both_bounds_and_a_session_by_its_share() -> None:
    ok = RequestSample(0.19, 0.019, 0.1, 0.01)
    assert ok.meets(SLO_1)
    assert not RequestSample(0.21, 0.01, 0.1, 0.01).meets(SLO_1)  # TTFT
    assert not RequestSample(0.1, 0.021, 0.1, 0.01).meets(SLO_1)  # TPOT
    assert not RequestSample(None, None, 0.1, 0.01).meets(SLO_1)  # failed
    assert RequestSample(0.1, None, 0.1, 0.01).meets(SLO_1)  # one output token: no TPOT
    bad = RequestSample(1.0, 0.01, 0.1, 0.01)
    assert SessionSample(True, (ok,) * 9 + (bad,)).meets(SLO_1)  # 90% of its requests
    assert not SessionSample(True, (ok,) * 8 + (bad,) * 2).meets(SLO_1)
    assert not SessionSample(False, (ok,) * 10).meets(SLO_1)  # did not complete
    assert not SessionSample(True, ()).meets(SLO_1)
    obs = Observation(1.0, (SessionSample(True, (ok,)), SessionSample(True, (bad,))))
    assert attainment(obs, SLO_1) == 0.5
    assert attainment(Observation(1.0, ()), SLO_1) == 0.0


def test_unloaded_latencies_are_the_profiles_formulas() -> None:
    p = load_profile("h100-llama3-8b")
    assert unloaded_ttft_s(p, 1000, 3000) == pytest.approx(
        p.prefill_s(1000, 3000) + p.decode_step_s(1, 4000)
    )
    assert unloaded_tpot_s(p, 4000) == p.decode_step_s(1, 4000)
    # the tight setting is tighter than the loose one on both bounds
    assert TIGHT.ttft_factor < LOOSE.ttft_factor and TIGHT.tpot_factor < LOOSE.tpot_factor


def test_the_bracket_grows_until_the_slo_fails_then_bisects_to_five_percent() -> None:
    run, calls = system(knee=100.0)
    res = search_capacity(run, SLO_1, SETTINGS)
    assert calls[:6] == [10.0, 20.0, 40.0, 80.0, 160.0, 120.0]  # doubling, then midpoints
    truth = sustained(100.0)
    assert res.status == "bracketed" and res.monotone
    assert res.capacity_per_min <= truth < res.upper  # type: ignore[operator]
    assert res.upper - res.capacity_per_min <= 0.05 * res.capacity_per_min  # type: ignore[operator]
    assert truth - res.capacity_per_min <= 0.05 * truth
    assert len(calls) == len(set(calls)) == len(res.trials)  # no rate run twice


def test_the_bracket_shrinks_when_the_start_rate_already_fails() -> None:
    run, calls = system(knee=3.0)
    res = search_capacity(run, SLO_1, SETTINGS)
    assert calls[:4] == [10.0, 5.0, 2.5, 3.75]
    assert res.status == "bracketed"
    assert res.capacity_per_min <= sustained(3.0) < res.upper  # type: ignore[operator]


def test_a_target_that_never_meets_the_slo_has_capacity_zero() -> None:
    run, calls = system(knee=0.1)
    res = search_capacity(run, SLO_1, SETTINGS)
    assert res.status == "never_met" and res.capacity_per_min == 0.0
    assert calls == [10.0, 5.0, 2.5, 1.25]  # the next, 0.625, is below the floor


def test_a_target_that_meets_the_slo_up_to_the_cap_is_capped_there() -> None:
    run, calls = system(knee=1e9)
    res = search_capacity(run, SLO_1, SETTINGS)
    assert res.status == "capped" and res.capacity_per_min == 1_000.0 and res.upper is None
    assert calls == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1000.0]


def test_a_noisy_system_still_terminates_and_is_flagged_when_not_monotone() -> None:
    rng = random.Random(7)

    def run(rate: float) -> Observation:
        # the true knee at 100/min, but each session flips a coin near it
        out = []
        for i in range(20):
            edge = 100.0 * (1 + i / 20) * rng.uniform(0.8, 1.2)
            ttft = 0.1 if rate <= edge else 0.5
            out.append(SessionSample(True, (RequestSample(ttft, 0.01, 0.1, 0.01),)))
        return Observation(rate, tuple(out))

    flagged = 0
    for _ in range(20):
        res = search_capacity(run, SLO_1, SETTINGS)
        assert res.status == "bracketed" and len(res.trials) <= SETTINGS.max_runs
        assert 60.0 <= res.capacity_per_min <= 180.0
        assert res.upper - res.capacity_per_min <= 0.05 * res.capacity_per_min  # type: ignore[operator]
        flagged += not res.monotone
    assert flagged  # some searches saw a met rate above a failed one, and said so


def test_a_discarded_run_bounds_the_search_and_is_said() -> None:
    base, _ = system(knee=1e9)

    def run(rate: float) -> Observation:
        obs = base(rate)
        if rate > 50.0:
            return Observation(rate, obs.sessions, discarded="host saturated")
        return obs

    res = search_capacity(run, SLO_1, SETTINGS)
    assert res.status == "machine_bound"
    assert 50.0 / 1.05 <= res.capacity_per_min <= 50.0 < res.upper  # type: ignore[operator]
    assert any(t.discarded == "host saturated" for t in res.trials)


def test_the_run_budget_stops_the_search_and_says_so() -> None:
    run, calls = system(knee=100.0)
    res = search_capacity(run, SLO_1, SearchSettings(10.0, 1_000.0, 1.0, max_runs=3))
    assert res.status == "budget" and len(calls) == 3 and res.capacity_per_min == 40.0


def test_searches_at_two_slos_share_the_runs_and_pick_each_best_shape() -> None:
    runs = {"a": system(knee=50.0), "b": system(knee=200.0)}
    loose = SLO("loose", ttft_factor=10.0, tpot_factor=10.0)
    result = search_target("t", ["a", "b"], lambda split: runs[split][0], [SLO_1, loose], SETTINGS)
    assert result.best("x").split == "b"
    assert result.capacity("x") == pytest.approx(sustained(200.0), rel=0.05)
    assert result.capacity("loose") == 1_000.0  # every run within 10×: capped
    for split, (_, calls) in runs.items():
        shape = next(s for s in result.shapes if s.split == split)
        assert len(calls) == len(set(calls)) == len(shape.runs)  # the loose search reran none


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        SearchSettings(start_rate=10.0, max_rate=5.0, min_rate=1.0)
    with pytest.raises(ValueError):
        SearchSettings(start_rate=10.0, max_rate=50.0, min_rate=1.0, growth=1.0)
    with pytest.raises(ValueError):
        SLO("bad", ttft_factor=0.0, tpot_factor=1.0)


def test_kendall_tau_counts_ties_within_the_tolerance() -> None:
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1.0], [1.0]) is None
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None
    # 100 and 103 are a tie within 5%: tau-b of one tie and two concordant pairs
    assert kendall_tau([100, 103, 200], [1, 2, 3], tie=0.05) == pytest.approx(2 / (3 * 2) ** 0.5)
    tau = capacity_ranking_tau({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 5.0, "b": 9.0, "x": 1.0})
    assert tau == pytest.approx(1.0)  # only the targets both have
