"""Dynamo's KV-router cost and its `isl_bounding` conditional disaggregation, at their numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.types import Role
from planner.policies import get_policy
from planner.policies.peers.dynamo import (
    DynamoConfig,
    DynamoKVPolicy,
    isl_bypass,
    kv_cost,
    overlap_credit,
)
from planner.types import Action
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()
CFG = DynamoConfig()
CAPACITY = 10_000  # UNIT: 1e9 bytes of KV / (1000 bytes per token · 100 tokens per block)


def test_tier_credits_are_one_three_quarters_one_quarter() -> None:
    assert overlap_credit(worker("w", Role.HYBRID, gpu=2, cpu=6, ssd=10), CFG) == 6.0
    assert overlap_credit(worker("w", Role.HYBRID, cpu=4), CFG) == 3.0
    assert overlap_credit(worker("w", Role.HYBRID, ssd=4), CFG) == 1.0


def test_cost_is_the_documented_formula() -> None:
    req = request(1000)  # 10 blocks
    # scale · max(active_prefill + new − credit, 0) + active_decode + new
    assert kv_cost(worker("a", Role.HYBRID, gpu=6), req, CAPACITY, CFG) == 4 + 0 + 10
    busy = worker("b", Role.HYBRID, kv_usage=0.0003, inflight_prefill_tokens=250)
    assert kv_cost(busy, req, CAPACITY, CFG) == pytest.approx((3 + 10) + 3 + 10)
    # credit beyond the request's blocks is clamped at 0 prefill
    assert kv_cost(worker("c", Role.HYBRID, gpu=20), req, CAPACITY, CFG) == 0 + 0 + 10
    scaled = replace(CFG, prefill_load_scale=2.0)
    assert kv_cost(worker("a", Role.HYBRID, gpu=6), req, CAPACITY, scaled) == 2 * 4 + 10


def test_policy_picks_the_least_cost_worker() -> None:
    pol = get_policy("dynamo-kv", UNIT_CONFIG, MODEL)
    assert isinstance(pol, DynamoKVPolicy)
    cl = cluster(
        worker("b", Role.HYBRID, kv_usage=0.0003),  # 10 + 3 + 10 = 23
        worker("d", Role.DECODE, gpu=6, inflight_prefill_tokens=250),  # 3 + 10 − 6 + 10 = 17
        worker("a", Role.HYBRID, gpu=6),  # 14
        worker("p", Role.PREFILL, gpu=10),  # cheapest, but a PREFILL worker does not decode
    )
    p = pol.plan(request(1000), cl)
    assert (p.chosen.prefill_worker, p.chosen.decode_worker) == ("a", "a")
    # a prefill backlog outweighs the overlap: 200 blocks queued on a
    cl2 = cluster(worker("a", Role.HYBRID, gpu=6, inflight_prefill_tokens=20_000),
                  worker("b", Role.HYBRID))  # fmt: skip
    assert pol.plan(request(1000), cl2).chosen.decode_worker == "b"


def test_isl_bounding_bypasses_only_below_both_thresholds() -> None:
    assert isl_bypass(request(4000), 20, CFG)  # effective ISL 2000 < 2048, ratio 0.5 < 0.7
    assert not isl_bypass(request(4000), 19, CFG)  # 2100 ≥ 2048
    assert not isl_bypass(request(2000), 6, CFG)  # 1400, ratio 0.7: not < 0.7
    assert isl_bypass(request(2000), 7, CFG)  # 1300, ratio 0.65


@pytest.mark.parametrize(
    ("d0_cached", "route"),
    [
        (20, (Action.COLOCATED_PREFILL, "d0", "d0")),  # effective ISL 2000: bypass
        (19, (Action.REMOTE_PREFILL, "p0", "d0")),  # 2100 ≥ 2048: remote prefill
    ],
)
def test_disagg_chooses_decode_first_then_local_or_remote_prefill(
    d0_cached: int, route: tuple[Action, str, str]
) -> None:
    pol = get_policy("dynamo-kv-disagg", UNIT_CONFIG, MODEL)
    c = cluster(worker("p0", Role.PREFILL), worker("d0", Role.DECODE, gpu=d0_cached),
                worker("d1", Role.DECODE))  # fmt: skip
    plan = pol.plan(request(4000), c)
    assert (plan.action, plan.chosen.prefill_worker, plan.chosen.decode_worker) == route


def test_capacity_is_the_pool_the_worker_reports_else_the_profiles() -> None:
    policy = get_policy("dynamo-kv", UNIT_CONFIG, MODEL)
    assert isinstance(policy, DynamoKVPolicy)
    req = request(1000)  # block size 100, K = 1000 bytes per token
    w = worker("w", Role.HYBRID)
    assert policy.capacity_blocks(w, req) == pytest.approx(1e9 / (1000 * 100))
    assert policy.capacity_blocks(replace(w, kv_capacity_tokens=8900), req) == 89
