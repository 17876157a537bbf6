"""planner/README.md's worked example: every number in its table comes out of the code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner.cost import enumerate_routes, evaluate
from planner.explain import plan_to_header
from planner.policies import OwnerServePolicy
from planner.types import Action
from tests.planner.util import UNIT_CONFIG, example, unit_model

README = Path(__file__).resolve().parents[2] / "planner" / "README.md"


def _table() -> list[list[str]]:
    text = README.read_text()
    body = text.split("<!-- worked-example:", 1)[1].split("<!-- /worked-example -->", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in body.splitlines() if line.startswith("| ")]
    return [r for r in rows if r[0] not in ("action", "---")]


def test_readme_table_is_what_evaluate_computes() -> None:
    model = unit_model()
    req, cl = example()
    routes = {
        (r.action.value, r.prefill.worker_id, r.decode.worker_id): r
        for r in enumerate_routes(req, cl)
    }
    rows = _table()
    assert len(rows) == len(routes) == 5
    for action, p, d, *nums in rows:
        b = evaluate(model, req, routes[(action, p, d)])
        got = [
            b.t_queue, b.t_compute, b.t_network, b.t_restore, b.m_hbm_bytes, b.i_decode, b.h_move,
            b.total,
        ]  # fmt: skip
        assert got == pytest.approx([float(x) for x in nums], abs=1e-12), (action, p, d)


def test_readme_plan_and_header() -> None:
    req, cl = example()
    plan = OwnerServePolicy(model=unit_model()).plan(req, cl)
    text = README.read_text()
    header = plan_to_header(plan)
    assert header in text
    assert plan.chosen.cost.total == pytest.approx(0.2472)
    assert plan.margin_s == pytest.approx(0.045416)
    assert "margin 0.045416 s, 5 candidates" in text
    assert plan.candidates_considered == 5
    free = replace(UNIT_CONFIG, migration_margin_s=0.0, migration_margin_rel=0.0)
    moved = OwnerServePolicy(model=unit_model(free)).plan(req, cl)
    assert moved.action is Action.STATE_MIGRATION
    assert f"to save {moved.margin_s:.5f} s" in " ".join(text.split())


def test_readme_hot_spot_numbers_are_the_tests_numbers() -> None:
    from tests.planner.test_ownerserve import fork_case

    text = " ".join(README.read_text().split())
    policy = OwnerServePolicy(model=unit_model())
    idle = policy.plan(*fork_case(owner_busy=False))
    hot = policy.plan(*fork_case(owner_busy=True))
    assert f"**{idle.chosen.cost.total:.4f} s**" in text
    assert f"**{hot.chosen.cost.total:.5f} s**" in text
    assert hot.add_replica_on == "d1" and "`replica=d1`" in text
