"""The baseline policies (planner/README.md, *Baselines*), the policy registry and the `Planner`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.config import Settings
from ownerserve.errors import ConfigError, InvalidRequestError, NoWorkerAvailableError
from ownerserve.types import Role
from planner.cost import Route, evaluate
from planner.policies import POLICY_NAMES, Planner, get_policy
from planner.types import Action, ClusterView
from tests.planner.util import UNIT_CONFIG, cluster, example, request, unit_model, worker

MODEL = unit_model()


def pd_cluster() -> ClusterView:
    return cluster(
        worker("p0", Role.PREFILL, inflight_prefill_tokens=5000),
        worker("p1", Role.PREFILL, "node1"),
        worker("d0", Role.DECODE, running=10, gpu=6),
        worker("d1", Role.DECODE, "node1", running=3),
        worker("h0", Role.HYBRID, running=1),
    )


def test_policy_names_and_registry() -> None:
    assert POLICY_NAMES == (
        "ownerserve", "static-pd", "colocated", "round-robin", "prefix-multi-owner",
        "least-loaded",
    )  # fmt: skip
    for name in POLICY_NAMES:
        assert get_policy(name, UNIT_CONFIG, MODEL).name == name
    with pytest.raises(ConfigError, match="unknown policy"):
        get_policy("oracle")


def test_static_pd_always_remote_least_loaded_in_role_pools() -> None:
    p = get_policy("static-pd", model=MODEL).plan(request(500), pd_cluster())
    assert (p.action, p.chosen.prefill_worker, p.chosen.decode_worker) == (
        Action.REMOTE_PREFILL, "p1", "d1",
    )  # fmt: skip
    assert p.candidates_considered == 4
    assert p.runner_up is not None and p.runner_up.decode_worker == "d0"
    # the breakdown is the shared cost model's
    cl = pd_cluster()
    route = Route(Action.REMOTE_PREFILL, cl.workers[1], cl.workers[3])
    assert p.chosen.cost == evaluate(MODEL, request(500), route)


def test_static_pd_uses_hybrids_when_a_pool_is_empty() -> None:
    cl = cluster(worker("h0", Role.HYBRID, running=4), worker("h1", Role.HYBRID, running=2))
    p = get_policy("static-pd", model=MODEL).plan(request(500), cl)
    assert p.action is Action.REMOTE_PREFILL  # both pools are the hybrids; P and D differ
    with pytest.raises(NoWorkerAvailableError):
        get_policy("static-pd", model=MODEL).plan(request(500), cluster(worker("p", Role.PREFILL)))


def test_colocated_picks_the_least_loaded_decode_capable_worker() -> None:
    p = get_policy("colocated", model=MODEL).plan(request(500), pd_cluster())
    assert (p.action, p.chosen.decode_worker) == (Action.COLOCATED_PREFILL, "h0")
    assert p.candidates_considered == 3


def test_round_robin_cycles_through_the_pools_ignoring_load_and_cache() -> None:
    pol = get_policy("round-robin", model=MODEL)
    got = [
        (p.chosen.prefill_worker, p.chosen.decode_worker)
        for p in (pol.plan(request(500), pd_cluster()) for _ in range(4))
    ]
    assert got == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_least_loaded_takes_the_least_loaded_p_and_d_of_any_role() -> None:
    p = get_policy("least-loaded", model=MODEL).plan(request(500), pd_cluster())
    # prefill load: p1 and h0 have 0 inflight tokens; decode load: h0 (1 running)
    assert p.chosen.decode_worker == "h0"
    assert p.chosen.prefill_worker in ("p1", "h0")
    # a hybrid-only cluster where one hybrid is the least loaded both ways: colocated
    cl = cluster(worker("h0", Role.HYBRID), worker("h1", Role.HYBRID, running=5, waiting=1,
                                                     inflight_prefill_tokens=100))  # fmt: skip
    p = get_policy("least-loaded", model=MODEL).plan(request(500), cl)
    assert (p.action, p.chosen.decode_worker) == (Action.COLOCATED_PREFILL, "h0")


def test_prefix_multi_owner_follows_the_longest_prefix_unless_imbalanced() -> None:
    cl = cluster(
        worker("d0", Role.DECODE, running=10, gpu=3),
        worker("d1", Role.DECODE, running=12, gpu=8),
        worker("d2", Role.DECODE, running=5),
    )
    pol = get_policy("prefix-multi-owner", model=MODEL)
    p = pol.plan(request(1000), cl)
    assert (p.action, p.chosen.decode_worker) == (Action.COLOCATED_PREFILL, "d1")
    # d1 overloaded: max − min = 95 > 32 and 100 > 1.5·5 → least loaded
    hot = replace(cl.workers[1], running=100)
    p = pol.plan(request(1000), replace(cl, workers=(cl.workers[0], hot, cl.workers[2])))
    assert p.chosen.decode_worker == "d2"


def test_prefix_multi_owner_in_pd_mode_is_cache_aware_on_prefill_workers() -> None:
    cl = cluster(
        worker("p0", Role.PREFILL),
        worker("p1", Role.PREFILL, "node1", gpu=8),
        worker("d0", Role.DECODE, running=3),
        worker("d1", Role.DECODE, "node1", running=1),
    )
    p = get_policy("prefix-multi-owner", model=MODEL).plan(request(1000), cl)
    assert (p.action, p.chosen.prefill_worker, p.chosen.decode_worker) == (
        Action.REMOTE_PREFILL, "p1", "d1",
    )  # fmt: skip
    # duplicates allowed: the prefix owned elsewhere is copied again, and M_HBM says so
    req = request(1000, owner="d0", owner_blocks=8)
    p = get_policy("prefix-multi-owner", model=MODEL).plan(req, cl)
    assert p.chosen.cost.m_hbm_bytes == pytest.approx(200 * 1000 + 800 * 1000)


def test_planner_resolves_the_per_request_override() -> None:
    planner = Planner(model=MODEL)
    req, cl = example()
    assert planner.for_request(None).plan(req, cl).policy == "ownerserve"
    assert planner.for_request("static-pd").plan(req, cl).policy == "static-pd"
    assert planner.for_request("static-pd") is planner.policy("static-pd")  # built once
    with pytest.raises(InvalidRequestError, match="unknown routing policy 'nope'"):
        planner.for_request("nope")
    with pytest.raises(ConfigError):
        planner.policy("nope")
    with pytest.raises(ConfigError):
        Planner(model=MODEL, default="nope")
    assert Planner(model=MODEL, default="colocated").for_request("").name == "colocated"


def test_planner_keeps_round_robin_state_and_accepts_extra_policies() -> None:
    rr = get_policy("round-robin", model=MODEL)
    planner = Planner(model=MODEL, default="oracle", extra={"oracle": rr})
    assert planner.default is rr and planner.names[-1] == "oracle"
    assert set(POLICY_NAMES) < set(planner.names)
    firsts = [planner.default.plan(request(500), pd_cluster()).chosen.prefill_worker
              for _ in range(2)]  # fmt: skip
    assert firsts == ["p0", "p1"]


def test_planner_from_settings_shares_the_deployments_model() -> None:
    settings = Settings.model_validate(
        {
            "planner": {"policy": "least-loaded", "lambda_hbm": 1e-9},
            "models": [{"name": "m", "kv_spec": "llama3-8b"}],
            "workers": [
                {"id": "w0", "url": "http://127.0.0.1:1", "profile": "h100-llama3-8b"},
            ],
        }
    )
    planner = Planner.from_settings(settings)
    assert planner.default.name == "least-loaded"
    assert planner.model.config.lam == 1e-9
    assert planner.model.config.kv_spec == "llama3-8b" and planner.model.spec is not None
    assert planner.model.config.profiles == ("h100-llama3-8b",)
    assert planner.policy("ownerserve").model is planner.model  # type: ignore[attr-defined]


def test_baselines_never_pick_unhealthy_workers() -> None:
    cl = pd_cluster()
    sick = tuple(replace(w, healthy=False) if w.worker_id in ("p1", "d1", "h0") else w
                 for w in cl.workers)  # fmt: skip
    for name in POLICY_NAMES:
        p = get_policy(name, model=MODEL).plan(request(500), replace(cl, workers=sick))
        assert {p.chosen.prefill_worker, p.chosen.decode_worker} <= {"p0", "d0"}, name
