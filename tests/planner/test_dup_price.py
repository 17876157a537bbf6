"""The duplicate's price: the reload of the KV a copy of someone else's prefix displaces on
the worker it lands on (planner.cost.RequestCosts.dup_price), ~0 on a free pool."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.types import Role
from planner.cost import RequestCosts
from planner.policies import OwnerServePolicy
from planner.types import RequestView
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
