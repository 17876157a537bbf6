"""Online calibration: bounded EWMA of observed/predicted per worker and kind."""

from __future__ import annotations

import math

import pytest

from ownerserve.types import Role
from planner.calibration import CalibrationConfig, Calibrator, WorkerScales
from planner.cost import RequestCosts, Route, enumerate_routes
from planner.policies import OwnerServePolicy
from planner.types import Action, Plan, RequestClass
from tests.planner.util import cluster, example, unit_model, worker


def test_one_sample_moves_the_scale_by_ratio_to_the_alpha() -> None:
    cal = Calibrator(CalibrationConfig(alpha=0.5))
    assert cal.observe_prefill("w", 2.0, 1.0)
    assert cal.scales("w").prefill == pytest.approx(math.sqrt(2.0))  # 1 · 2^0.5
    assert cal.scales("w").decode == 1.0 and cal.scales("w").link == 1.0
    assert cal.scales("other") == WorkerScales()


def test_scale_converges_to_the_true_ratio_when_predictions_use_it() -> None:
    cal = Calibrator()
    raw = 0.1
    for _ in range(60):
        predicted = raw * cal.scales("w").decode  # the planner predicts with the current scale
        cal.observe_decode("w", 3.0 * raw, predicted)
    assert cal.scales("w").decode == pytest.approx(3.0, rel=1e-3)


def test_outliers_and_scales_are_bounded() -> None:
    cal = Calibrator(CalibrationConfig(alpha=1.0, max_sample_ratio=4.0, max_scale=8.0))
    cal.observe_transfer("w", 1000.0, 1.0)  # a 1000× outlier counts as 4×
    assert cal.scales("w").link == pytest.approx(4.0)
    cal.observe_transfer("w", 1000.0, 1.0)
    assert cal.scales("w").link == pytest.approx(8.0)  # clamped at max_scale
    for _ in range(10):
        cal.observe_transfer("w", 1e-6, 1.0)
    assert cal.scales("w").link == pytest.approx(0.25)  # min_scale


@pytest.mark.parametrize(
    ("observed", "predicted"),
    [(1.0, 0.0), (1.0, 1e-9), (0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, math.inf),
     (math.inf, 1.0)],
)  # fmt: skip
def test_useless_samples_are_ignored(observed: float, predicted: float) -> None:
    cal = Calibrator()
    assert not cal.observe_prefill("w", observed, predicted)
    assert cal.samples == 0 and cal.snapshot() == {}


def test_bad_config_is_rejected() -> None:
    for kw in ({"alpha": 0.0}, {"alpha": 1.5}, {"min_scale": 2.0}, {"max_sample_ratio": 0.5}):
        with pytest.raises(ValueError):
            CalibrationConfig(**kw)


def test_observe_plan_feeds_prefill_decode_and_link_of_the_plan_workers() -> None:
    req, cl = example()
    policy = OwnerServePolicy(model=unit_model())
    plan = policy.plan(req, cl)  # colocated on d0: t_queue 0.01 + t_prefill 0.0572
    cal = Calibrator(CalibrationConfig(alpha=1.0))
    b = plan.chosen.cost
    used = cal.observe_plan(
        plan, ttft_s=2 * (b.t_queue + b.t_prefill), tpot_s=b.t_decode_step * 0.5, transfer_s=1.0
    )
    assert used == 2  # no network in a colocated plan: the transfer time is not a sample
    s = cal.scales("d0")
    assert (s.prefill, s.decode, s.link) == (pytest.approx(2.0), pytest.approx(0.5), 1.0)


def test_observe_plan_transfer_sample_goes_to_the_receiving_worker() -> None:
    req, cl = example()
    p0, d0 = cl.workers[0], cl.workers[1]
    remote = RequestCosts(unit_model(), req).candidate(Route(Action.REMOTE_PREFILL, p0, d0))
    plan = Plan(policy="x", request_class=RequestClass.NEW_LONG_PREFIX, chosen=remote)
    cal = Calibrator(CalibrationConfig(alpha=1.0))
    assert 0.0 < remote.cost.t_transfer < remote.cost.t_network  # without the handshake
    assert cal.observe_plan(plan, transfer_s=2 * remote.cost.t_transfer) == 1
    assert cal.scales("d0").link == pytest.approx(2.0)
    assert cal.scales("p0") == WorkerScales()


def test_link_scale_and_handover_overhead_converge_to_their_own_truths_together() -> None:
    """A synthetic run of remote prefills p0 -> d0 whose link is 2.5x slower than the profile
    and whose hand-over costs 0.3 s more than predicted: each plan is priced with the scales
    learnt so far, both samples are fed back. Against t_network (which holds the overhead
    being learnt and the handshake) the link scale would settle low; against the transfer's
    own seconds both converge to the truth."""
    req, cl = example()
    p0, d0 = cl.workers[0], cl.workers[1]
    model = unit_model()
    cal = Calibrator()
    true_link, true_overhead = 2.5, 0.3
    raw = RequestCosts(model, req).candidate(Route(Action.REMOTE_PREFILL, p0, d0)).cost
    for _ in range(200):
        cand = RequestCosts(model, req).candidate(Route(Action.REMOTE_PREFILL, p0, cal.apply(d0)))
        b = cand.cost
        transfer = true_link * raw.t_transfer
        ttft = b.t_queue + b.t_prefill + transfer + model.config.pd_handshake_s + true_overhead
        plan = Plan(policy="x", request_class=RequestClass.NEW_LONG_PREFIX, chosen=cand)
        cal.observe_plan(plan, ttft_s=ttft, transfer_s=transfer)
    assert cal.scales("d0").link == pytest.approx(true_link, rel=1e-3)
    assert cal.scales("d0").handover_s == pytest.approx(true_overhead, abs=1e-3)


def test_apply_puts_the_scales_into_the_views_and_forget_drops_them() -> None:
    cal = Calibrator(CalibrationConfig(alpha=1.0))
    cal.observe_prefill("a", 2.0, 1.0)
    cl = cluster(worker("a", Role.HYBRID), worker("b", Role.HYBRID))
    out = cal.apply_all(cl)
    assert out.workers[0].prefill_scale == pytest.approx(2.0)
    assert out.workers[1] is cl.workers[1]
    cal.forget("a")
    assert cal.apply(cl.workers[0]) is cl.workers[0]


def test_a_remote_prefill_ttft_teaches_the_decode_workers_pd_overhead_not_ps_scale() -> None:
    req, cl = example()
    p0, d0 = cl.workers[0], cl.workers[1]
    model = unit_model()
    remote = RequestCosts(model, req).candidate(Route(Action.REMOTE_PREFILL, p0, d0))
    b = remote.cost
    predicted = b.t_queue + b.t_prefill + b.t_network + b.t_restore
    plan = Plan(policy="x", request_class=RequestClass.NEW_LONG_PREFIX, chosen=remote)
    cal = Calibrator(CalibrationConfig(alpha=0.5))
    assert cal.observe_plan(plan, ttft_s=predicted + 0.4) == 1
    assert cal.scales("d0").handover_s == pytest.approx(0.2)
    assert cal.scales("p0") == WorkerScales()  # P's prefill scale learns nothing from it
    # the overhead reaches the planner: T_network into d0 grows by it
    view = cal.apply(d0)
    assert view.handover_s == pytest.approx(0.2)
    again = RequestCosts(model, req).candidate(Route(Action.REMOTE_PREFILL, p0, view))
    assert again.cost.t_network == pytest.approx(b.t_network + 0.2)
    # faster than predicted brings it down, never below 0; bounded above
    cal.observe_handover("d0", 0.001, 10.0)
    assert cal.scales("d0").handover_s == 0.0
    for _ in range(60):
        cal.observe_handover("d0", 1000.0, 0.0)
    assert cal.scales("d0").handover_s == CalibrationConfig().max_handover_s
    assert not cal.observe_handover("d0", math.nan, 0.1)


def test_a_migration_that_moved_kv_teaches_the_receiving_workers_handover() -> None:
    req, cl = example()
    model = unit_model()
    route = next(r for r in enumerate_routes(req, cl) if r.action is Action.STATE_MIGRATION)
    cand = RequestCosts(model, req).candidate(route)
    b = cand.cost
    assert b.t_network > 0
    plan = Plan(policy="x", request_class=RequestClass.NEW_LONG_PREFIX, chosen=cand)
    cal = Calibrator(CalibrationConfig(alpha=1.0))
    predicted = b.t_queue + b.t_prefill + b.t_network + b.t_restore
    assert cal.observe_plan(plan, ttft_s=predicted + 0.3) == 1
    assert cal.scales(cand.prefill_worker).handover_s == pytest.approx(0.3)
    assert cal.scales(cand.prefill_worker).prefill == 1.0
    view = cal.apply(route.prefill)
    again = RequestCosts(model, req).candidate(type(route)(route.action, view, view, route.source))
    assert again.cost.t_network == pytest.approx(b.t_network + 0.3)
