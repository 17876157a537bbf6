"""The plan as a header and as a dict."""

from __future__ import annotations

import json
from dataclasses import replace

from ownerserve.types import Role
from planner.explain import (
    DECISION_TERMS,
    NOT_BY_COST,
    ONLY_CANDIDATE,
    deciding_term,
    parse_plan_header,
    plan_to_dict,
    plan_to_header,
)
from planner.policies import OwnerServePolicy
from planner.types import Action, Candidate, CostBreakdown, Plan, RequestClass
from tests.planner.test_ownerserve import fork_case
from tests.planner.util import cluster, example, request, unit_model, worker

POLICY = OwnerServePolicy(model=unit_model())


def test_header_of_the_worked_example() -> None:
    req, cl = example()
    h = plan_to_header(POLICY.plan(req, cl))
    assert h == (
        "policy=ownerserve;class=small_incremental_turn;action=colocated_prefill;p=d0;d=d0;"
        "cost=0.2472;runner_up=state_migration@d1:0.292616;margin=0.045416"
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


def _plan(chosen: CostBreakdown, runner: CostBreakdown | None) -> Plan:
    def cand(action: Action, cost: CostBreakdown) -> Candidate:
        return Candidate(action, "w0", "w0", cost)

    return Plan(
        "ownerserve",
        RequestClass.SMALL_INCREMENTAL_TURN,
        cand(Action.DECODE_CONTINUATION, chosen),
        None if runner is None else cand(Action.COLOCATED_PREFILL, runner),
    )


def test_the_deciding_term_is_where_the_choice_saves_most_against_the_runner_up() -> None:
    # the owner is busier (queue +0.1 s) but holds the prefix (compute -0.25 s): compute
    owner = CostBreakdown(t_queue=0.12, t_compute=0.05)
    idle = CostBreakdown(t_queue=0.02, t_compute=0.30)
    assert deciding_term(_plan(owner, idle)) == "compute"
    # the idle worker wins on its queue against a small saving in compute: queue
    busy = CostBreakdown(t_queue=0.50, t_compute=0.05)
    assert deciding_term(_plan(idle, busy)) == "queue"
    # weighted terms count as weighted: λ·M_HBM, μ·I_decode
    cheap_hbm = CostBreakdown(t_compute=0.1, m_hbm_bytes=1e6, lam=1e-9)
    dear_hbm = CostBreakdown(t_compute=0.09, m_hbm_bytes=1e9, lam=1e-9)
    assert deciding_term(_plan(cheap_hbm, dear_hbm)) == "hbm"
    quiet = CostBreakdown(t_compute=0.1, i_decode=0.0, mu=2.0)
    loud = CostBreakdown(t_compute=0.1, i_decode=0.2, mu=2.0)
    assert deciding_term(_plan(quiet, loud)) == "interference"
    stay = CostBreakdown(t_compute=0.1)
    move = CostBreakdown(t_compute=0.05, t_network=0.02, h_move=0.2)
    assert deciding_term(_plan(stay, move)) == "move"
    assert deciding_term(_plan(stay, CostBreakdown(t_compute=0.1, w_disp=0.3))) == "displacement"
    assert deciding_term(_plan(stay, CostBreakdown(t_compute=0.1, t_restore=0.3))) == "restore"
    assert deciding_term(_plan(stay, CostBreakdown(t_compute=0.1, t_network=0.3))) == "network"


def test_the_deciding_term_without_a_runner_up_or_against_the_cost_model() -> None:
    one = CostBreakdown(t_compute=0.1)
    assert deciding_term(_plan(one, None)) == ONLY_CANDIDATE
    # a baseline policy chose the costlier candidate by its own rule
    assert deciding_term(_plan(CostBreakdown(t_compute=0.3), one)) == NOT_BY_COST
    # a tie is no saving anywhere: the first term, not a made-up reason
    assert deciding_term(_plan(one, one)) == DECISION_TERMS[0]


def test_the_deciding_term_of_real_plans() -> None:
    # the worked example: staying beats migrating the state; the migration's hysteresis
    # (0.072 s) outweighs what it saves in interference (-0.058 s) and queue (-0.01 s)
    req, cl = example()
    plan = POLICY.plan(req, cl)
    assert plan.runner_up is not None and plan.runner_up.action.value == "state_migration"
    assert plan.runner_up.cost.h_move > 0.07 and plan.chosen.cost.h_move == 0
    assert deciding_term(plan) == "move"
