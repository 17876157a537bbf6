"""How often the planner's copies are hit again (planner.copyreuse), and X_dup weighed by it:
a fetch's replica and a remote prefill's prompt kept on P pay 1 / max(u, floor) times their
displacement (planner.cost.reuse_weight); u = 1 prices them as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.types import Role
from planner.copyreuse import CopyKind, CopyReuse, CopyReuseConfig, copies, hits
from planner.cost import RequestCosts, Route, reuse_weight
from planner.policies import OwnerServePolicy
from planner.types import Action, Candidate, CostBreakdown, Plan, RequestClass, RequestView
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

LOW_LAMBDA = replace(UNIT_CONFIG, lam=1e-11, xi=1.0)


def _plan(action: Action, p: str, d: str, source: str | None = None) -> Plan:
    return Plan(
        "test", RequestClass.NEW_LONG_PREFIX, Candidate(action, p, d, CostBreakdown(), source)
    )


def test_the_rate_is_one_until_copies_go_unhit_past_the_horizon() -> None:
    r = CopyReuse(CopyReuseConfig(alpha=0.5, horizon_s=5.0))
    chain = (10, 11, 12, 13)
    assert r.rate(CopyKind.FETCH, 0.0) == 1.0
    r.copied("w1", chain, 1, 3, CopyKind.FETCH, 0.0)  # blocks 11, 12
    r.copied("w1", chain, 1, 2, CopyKind.FETCH, 1.0)  # still followed: the same copy
    r.copied("w2", chain, 0, 1, CopyKind.FETCH, 1.0)
    assert r.tracked() == 3
    r.hit("w1", chain, 1, 2.0)  # reuses block 10 only: not w1's copy
    r.hit("w1", (10, 99, 12), 3, 2.0)  # another chain through 12: not w1's copy either
    assert r.tracked() == 3
    r.hit("w1", chain, 2, 2.0)  # reaches block 11: w1's copy served, both its blocks
    assert r.samples[CopyKind.FETCH] == 2 and r.tracked() == 1
    assert r.rate(CopyKind.FETCH, 2.0) == 1.0
    assert r.rate(CopyKind.FETCH, 5.9) == 1.0
    assert r.rate(CopyKind.FETCH, 6.1) == pytest.approx(0.5)  # w2's copy unhit past 5 s
    assert r.tracked() == 0
    assert r.samples[CopyKind.FETCH] == 3
    assert r.rate(CopyKind.PROMPT, 10.0) == 1.0  # kinds apart
    # a copy of n blocks counts n samples of its outcome
    big = CopyReuse(CopyReuseConfig(alpha=0.5, horizon_s=5.0))
    big.copied("w1", chain, 0, 3, CopyKind.PROMPT, 0.0)
    assert big.rate(CopyKind.PROMPT, 10.0) == pytest.approx(0.5**3)
    capped = CopyReuse(CopyReuseConfig(alpha=1.0, max_tracked=2))
    for i in range(3):
        capped.copied("w1", chain, i, i + 1, CopyKind.PROMPT, 0.0)
    assert capped.tracked() == 2
    assert capped.rate(CopyKind.PROMPT, 0.0) == 0.0


def test_a_plan_says_which_blocks_it_copies_and_which_it_hits() -> None:
    chain = tuple(range(100, 110))
    req = replace(request(1000, owner="d0", owner_blocks=6), chain=chain)
    view = cluster(
        worker("d0", Role.DECODE, gpu=6),
        worker("d1", Role.DECODE, gpu=2),
        worker("p0", Role.PREFILL),
    )
    fetch = _plan(Action.ARTIFACT_FETCH, "d1", "d1", "d0")
    assert copies(fetch, req, view) == [("d1", 2, 6, CopyKind.FETCH)]
    assert hits(fetch, req, view) == [("d1", 2), ("d0", 6)]
    remote = _plan(Action.REMOTE_PREFILL, "p0", "d0")
    assert copies(remote, req, view) == [("p0", 6, 10, CopyKind.PROMPT)]
    assert hits(remote, req, view) == [("d0", 6)]
    assert copies(_plan(Action.COLOCATED_PREFILL, "d0", "d0"), req, view) == []
    # observed: d1's replica is followed from the fetch, and served by the next plan reusing
    # it there
    r = CopyReuse(CopyReuseConfig(alpha=1.0, horizon_s=5.0))
    r.observe(fetch, req, view, 0.0)
    assert r.tracked() == 4
    after = cluster(worker("d1", Role.DECODE, gpu=6))
    r.observe(_plan(Action.COLOCATED_PREFILL, "d1", "d1"), req, after, 1.0)
    assert r.tracked() == 0
    assert r.rate(CopyKind.FETCH, 1.0) == 1.0


def _owner_busy() -> tuple[RequestView, list]:
    """d0 owns 19,900 tokens of a 20,000-token prompt behind 1 s of queued prefill; d1 is
    idle with a pool 30% cached: fetching to d1 beats queueing on d0 at the price of today."""
    owner = worker("d0", Role.DECODE, gpu=199, inflight_prefill_tokens=10_000)
    return request(20_000, owner="d0", owner_blocks=199), [
        owner,
        worker("d1", Role.DECODE, cached_tokens=300_000),
    ]


def test_a_fetch_whose_replicas_go_unreused_pays_its_displacement_per_reuse() -> None:
    req, ws = _owner_busy()
    k1 = RequestCosts(unit_model(LOW_LAMBDA), req)
    route = Route(Action.ARTIFACT_FETCH, ws[1], ws[1], ws[0])
    base = k1.candidate(route).cost
    x_dup = k1.worker(ws[1]).w_disp_s
    assert x_dup > 0
    assert base.w_disp == pytest.approx(x_dup)  # u = 1: as before
    low = replace(req, fetch_reuse=0.1)  # below the floor 0.25: 4 × X_dup
    k = RequestCosts(unit_model(LOW_LAMBDA), low)
    assert reuse_weight(0.1, 0.25) == 4.0 and reuse_weight(0.5, 0.25) == 2.0
    assert k.candidate(route).cost.w_disp == pytest.approx(4 * x_dup)
    # a colocated recompute on d1 (no fetch) is priced as before
    col = Route(Action.COLOCATED_PREFILL, ws[1], ws[1])
    assert k.candidate(col).cost.w_disp == pytest.approx(k1.candidate(col).cost.w_disp)
    # the search: with reused replicas it fetches to d1, with unreused ones it stays on d0
    policy = OwnerServePolicy(model=unit_model(LOW_LAMBDA))
    fetched = policy.plan(req, cluster(*ws))
    assert fetched.chosen.action is Action.ARTIFACT_FETCH
    assert fetched.chosen.cost.total == pytest.approx(base.total)
    sticky = policy.plan(low, cluster(*ws))
    assert sticky.chosen.decode_worker == "d0"
    # u = 1 whatever the floor: today's price
    same = RequestCosts(unit_model(replace(LOW_LAMBDA, copy_reuse_floor=1.0)), low)
    assert same.candidate(route).cost.w_disp == pytest.approx(x_dup)


def test_a_remote_prefills_prompt_copy_is_weighed_by_its_reuse() -> None:
    req = request(20_000)
    full_p = worker("p0", Role.PREFILL, cached_tokens=900_000)
    d0 = worker("d0", Role.DECODE, running=20)
    price = RequestCosts(unit_model(LOW_LAMBDA), req).copy_price(full_p, 0, 0.0)
    assert price > 0
    k = RequestCosts(unit_model(LOW_LAMBDA), replace(req, prompt_reuse=0.5))
    assert k.copy_price(full_p, 0, 0.0) == pytest.approx(2 * price)
    remote = k.candidate(Route(Action.REMOTE_PREFILL, full_p, d0)).cost
    assert remote.w_disp == pytest.approx(2 * price)
