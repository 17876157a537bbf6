"""The plan as a header and as a dict."""

from __future__ import annotations

import json
from dataclasses import replace

from ownerserve.types import Role
from planner.explain import parse_plan_header, plan_to_dict, plan_to_header
from planner.policies import OwnerServePolicy
from tests.planner.test_ownerserve import fork_case
from tests.planner.util import cluster, example, request, unit_model, worker

POLICY = OwnerServePolicy(model=unit_model())


def test_header_of_the_worked_example() -> None:
    req, cl = example()
    h = plan_to_header(POLICY.plan(req, cl))
    assert h == (
        "policy=ownerserve;class=small_incremental_turn;action=colocated_prefill;p=d0;d=d0;"
        "cost=0.2448;runner_up=state_migration@d1:0.291296;margin=0.046496"
    )
    assert h.isascii() and "\n" not in h


def test_header_names_source_replica_and_overridden_default() -> None:
    req, cl = fork_case(owner_busy=True)
    h = plan_to_header(POLICY.plan(req, cl))
    assert "action=artifact_fetch;p=d1;d=d1;src=d0;" in h
    assert ";replica=d1" in h
    assert "default=" not in h  # the fork's default (fetch) was chosen
    req, cl = fork_case(owner_busy=False)
    h = plan_to_header(POLICY.plan(req, cl))
    assert h.endswith(";default=artifact_fetch:0.10596")


def test_header_is_safe_for_odd_worker_ids() -> None:
    cl = cluster(worker("d;0=x y\u00e9", Role.DECODE))
    h = plan_to_header(POLICY.plan(request(100), cl))
    assert "d=d_0_x_y_;" in h and h.isascii()


def test_dict_is_json_ready_and_complete() -> None:
    req, cl = example()
    plan = POLICY.plan(replace(req), cl)
    d = json.loads(json.dumps(plan_to_dict(plan)))
    assert d["action"] == "colocated_prefill"
    assert d["chosen"]["cost"]["total_s"] == plan.chosen.cost.total
    assert d["chosen"]["cost"]["t_queue_s"] == 0.01
    assert d["runner_up"]["action"] == "state_migration"
    assert d["runner_up"]["cost"]["h_move_s"] == plan.runner_up.cost.h_move > 0  # type: ignore[union-attr]
    assert d["chosen"]["cost"]["h_move_s"] == 0.0
    assert d["margin_s"] == plan.margin_s
    assert d["candidates_considered"] == 5
    assert d["default_action"] == "colocated_prefill" and d["overrides_default"] is False


def test_header_parses_back_into_its_fields() -> None:
    plan = POLICY.plan(*fork_case(owner_busy=True))
    fields = parse_plan_header(plan_to_header(plan))
    assert fields["action"] == "artifact_fetch" and fields["src"] == "d0"
    assert fields["replica"] == "d1"
    overridden = parse_plan_header(plan_to_header(POLICY.plan(*fork_case(owner_busy=False))))
    assert overridden["default"] == "artifact_fetch:0.10596"
    assert parse_plan_header("") == {} and parse_plan_header("x;a=b=c") == {"a": "b=c"}
