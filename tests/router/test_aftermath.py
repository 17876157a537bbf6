"""The router's aftermath: what a served answer teaches the calibrator."""

from __future__ import annotations

import pytest

from ownerserve.directory.base import Match
from planner.calibration import CalibrationConfig, Calibrator
from planner.policies import OwnerServePolicy
from router.aftermath import observe
from router.services import ObserveServices
from router.telemetry import RouterMetrics
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
