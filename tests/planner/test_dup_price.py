"""The duplicate's price: the reload of the KV a copy of someone else's prefix displaces on
the worker it lands on (planner.cost.RequestCosts.dup_price), ~0 on a free pool."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.types import Role
from planner.cost import RequestCosts, Route
from planner.policies import OwnerServePolicy
from planner.types import Action, RequestView
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

LOW_LAMBDA = replace(UNIT_CONFIG, lam=1e-11, xi=1.0)  # the shipped λ: a copy's bytes cost ~nothing


def _turn() -> RequestView:
    """20,000 tokens whose first 19,900 are owned by d0 (no session owner: a fetch may copy)."""
    return request(20_000, owner="d0", owner_blocks=199)


def test_the_price_is_zero_on_an_empty_pool_and_rises_as_it_fills() -> None:
    k = RequestCosts(unit_model(LOW_LAMBDA), _turn())
    prices = [k.worker(worker("d1", Role.DECODE, kv_usage=u)).w_disp_s for u in (0.0, 0.3, 0.6)]
    prices.append(k.worker(worker("d1", Role.DECODE, ws_tokens=900_000)).w_disp_s)
    assert prices[0] == 0.0
    assert prices[0] < prices[1] < prices[2] < prices[3]
    # ρ = 0.9 from the working set: 0.9·19,900 tokens of the copy, recomputed on the unit
    # profile (per_token_s 1e-4, per_token_ctx_s 1e-8)
    d = 0.9 * 19_900
    assert prices[3] == pytest.approx((1e-4 + 1e-8 * d / 2) * d)
    # the owner duplicates nothing: no price however full it is
    assert k.worker(worker("d0", Role.DECODE, gpu=199, kv_usage=0.9)).w_disp_s == 0.0
    # a worker that offloads reloads the displaced KV from CPU when that is cheaper
    off = k.worker(worker("d1", Role.DECODE, ws_tokens=900_000, offloads=True)).w_disp_s
    assert off == pytest.approx(d * 1000 / 1e9)
    # ξ = 0 turns it off
    k0 = RequestCosts(unit_model(replace(LOW_LAMBDA, xi=0.0)), _turn())
    assert k0.worker(worker("d1", Role.DECODE, kv_usage=0.9)).w_disp_s == 0.0


def test_a_copy_onto_a_full_worker_loses_to_the_sticky_plan() -> None:
    """d0 owns the prefix and has 0.5 s of prefill queued; d1 is idle. With a free pool the
    copy to d1 (fetch or recompute) is cheaper than queueing on d0; with d1's pool full of
    running KV the copy's displacement makes staying on d0 the cheaper plan. Without the price
    (ξ = 0, λ = 1e-11) the copy onto the full worker wins."""
    owner = worker("d0", Role.DECODE, gpu=199, inflight_prefill_tokens=5_000)
    policy = OwnerServePolicy(model=unit_model(LOW_LAMBDA))
    free = policy.plan(_turn(), cluster(owner, worker("d1", Role.DECODE)))
    assert free.chosen.decode_worker == "d1"
    full = cluster(owner, worker("d1", Role.DECODE, kv_usage=0.9))
    sticky = policy.plan(_turn(), full)
    assert sticky.chosen.decode_worker == "d0"
    unpriced = OwnerServePolicy(model=unit_model(replace(LOW_LAMBDA, xi=0.0)))
    assert unpriced.plan(_turn(), full).chosen.decode_worker == "d1"


def test_the_idle_prefix_cache_counts_as_reusable_kv() -> None:
    """A pool full of idle cached prefixes (no running KV, no working set) prices a copy as a
    pool full of working sets does: the copy evicts that cache. Cached tokens below the
    running KV change nothing."""
    k = RequestCosts(unit_model(LOW_LAMBDA), _turn())
    cached = k.worker(worker("d1", Role.DECODE, cached_tokens=900_000)).w_disp_s
    ws = k.worker(worker("d1", Role.DECODE, ws_tokens=900_000)).w_disp_s
    assert cached == pytest.approx(ws)
    d = 0.9 * 19_900
    assert cached == pytest.approx((1e-4 + 1e-8 * d / 2) * d)
    running = k.worker(worker("d1", Role.DECODE, kv_usage=0.6)).w_disp_s
    assert k.worker(worker("d1", Role.DECODE, kv_usage=0.6, cached_tokens=500_000)).w_disp_s == (
        pytest.approx(running)
    )
    assert k.worker(worker("d1", Role.DECODE, cached_tokens=0)).w_disp_s == 0.0


def test_a_remote_prefill_pays_for_its_transient_copy_on_p() -> None:
    """A new 20,000-token prompt (no owner, so nothing else is a duplicate): a remote prefill
    leaves the whole prompt on P as well as on D, where colocating leaves it once. On a P
    whose pool is 90% cached the copy's X_dup is the reload of 0.9·20,000 tokens, in W_disp;
    on an empty P it is 0, and colocated routes never pay it."""
    req = request(20_000)
    k = RequestCosts(unit_model(LOW_LAMBDA), req)
    full_p = worker("p0", Role.PREFILL, cached_tokens=900_000)
    empty_p = worker("p1", Role.PREFILL)
    d0 = worker("d0", Role.DECODE, running=20)  # colocating would stall its 20 decodes
    d = 0.9 * 20_000
    price = (1e-4 + 1e-8 * d / 2) * d
    assert k.copy_price(full_p, 0, 0.0) == pytest.approx(price)
    assert k.worker(full_p).w_disp_s == 0.0  # nothing is charged until the route is remote
    remote = k.candidate(Route(Action.REMOTE_PREFILL, full_p, d0)).cost
    assert remote.w_disp == pytest.approx(price)
    assert k.candidate(Route(Action.REMOTE_PREFILL, empty_p, d0)).cost.w_disp == 0.0
    full_h = worker("h0", Role.HYBRID, cached_tokens=900_000)
    assert k.candidate(Route(Action.COLOCATED_PREFILL, full_h, full_h)).cost.w_disp == 0.0
    # the search charges it too: of two otherwise equal P workers the empty one is chosen
    plan = OwnerServePolicy(model=unit_model(LOW_LAMBDA)).plan(req, cluster(full_p, empty_p, d0))
    assert plan.chosen.action is Action.REMOTE_PREFILL
    assert plan.chosen.prefill_worker == "p1"
    unpriced = OwnerServePolicy(model=unit_model(replace(LOW_LAMBDA, xi=0.0)))
    assert unpriced.plan(req, cluster(full_p, empty_p, d0)).chosen.prefill_worker == "p0"
