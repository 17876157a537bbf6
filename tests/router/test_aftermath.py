"""The router's aftermath: what a served answer teaches the calibrator, and how its prompt's
prefix reuse is counted."""

from __future__ import annotations

import pytest

from ownerserve.directory.base import Holding, HoldKind, Match
from ownerserve.types import Tier
from planner.calibration import CalibrationConfig, Calibrator
from planner.policies import OwnerServePolicy
from planner.types import Action, Candidate, CostBreakdown, Plan, RequestClass
from router.aftermath import observe, record_reuse
from router.services import ObserveServices
from router.telemetry import PREFIX_KINDS, RouterMetrics
from tests.planner.util import example, unit_model


def _served(queued_s: float) -> Calibrator:
    """A colocated plan whose worker really took twice its prediction, answered after the
    request waited `queued_s` in admission: the calibrator after it."""
    req, cl = example()
    plan = OwnerServePolicy(model=unit_model()).plan(req, cl)
    b = plan.chosen.cost
    assert b.t_network == 0.0 and b.t_restore == 0.0  # colocated: TTFT is queue + prefill
    predicted = b.t_queue + b.t_prefill
    cal = Calibrator(CalibrationConfig(alpha=1.0))
    svc = ObserveServices(RouterMetrics(), cal)
    ttft = queued_s + 2.0 * predicted  # measured from arrival, as the pipeline measures it
    observe(svc, plan, Match(chain_len=0), None, True, ttft, None, ttft, None, queued_s)
    return cal


def test_admission_wait_is_not_learnt_as_the_workers_prefill_scale() -> None:
    cal = _served(queued_s=3.0)
    worker = cal.snapshot()
    assert len(worker) == 1
    (scales,) = worker.values()
    assert scales.prefill == pytest.approx(2.0)  # the worker's own 2x, not (3 + 2p)/p


def test_without_a_queue_the_sample_is_the_whole_ttft() -> None:
    cal = _served(queued_s=0.0)
    (scales,) = cal.snapshot().values()
    assert scales.prefill == pytest.approx(2.0)


def _prefix_tokens(metrics: RouterMetrics) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["model"], s.labels["worker"], s.labels["kind"]): s.value
        for family in metrics.registry.collect()
        if family.name == "ownerserve_prefix_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_prefix_reuse_is_counted_under_the_prefill_worker_each_kind_capped_at_the_prompt() -> None:
    metrics = RouterMetrics()
    svc = ObserveServices(metrics, Calibrator())
    plan = Plan(
        "fixed",
        RequestClass.SMALL_INCREMENTAL_TURN,
        Candidate(Action.REMOTE_PREFILL, "p0", "d0", CostBreakdown(), reused_blocks=3),
    )
    match = Match(
        chain_len=6,
        holdings=(
            Holding("d1", Tier.GPU, 5, HoldKind.CACHED),
            Holding("p0", Tier.GPU, 3, HoldKind.OWNER),
            Holding("d0", Tier.CPU, 6, HoldKind.CACHED),  # every tier and worker counts
        ),
    )
    record_reuse(svc, "tiny", plan, match, 90, 16, 40)
    record_reuse(svc, "tiny", plan, Match(chain_len=6), 90, 16, None)  # reported nothing
    got = _prefix_tokens(metrics)
    assert {k: v for k, v in got.items() if v} == {
        ("tiny", "p0", "prompt"): 180,
        ("tiny", "p0", "available"): 90,  # 6 blocks of 16, capped at the 90-token prompt
        ("tiny", "p0", "predicted"): 96,  # 3 blocks, twice
        ("tiny", "p0", "delivered"): 40,
        ("tiny", "p0", "reported"): 90,  # the one answer that said
    }
    assert set(got) == {("tiny", "p0", kind) for kind in PREFIX_KINDS}
