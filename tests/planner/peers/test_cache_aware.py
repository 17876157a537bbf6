"""The SGLang/vLLM `cache_aware` rule at its thresholds: balance 64 / 1.5, cache 0.3."""

from __future__ import annotations

from dataclasses import replace

from ownerserve.types import Role
from planner.policies import get_policy
from planner.policies.peers.cache_aware import (
    SGLANG,
    VLLM,
    CacheAwarePolicy,
    CacheAwareSelector,
    imbalanced,
)
from planner.types import Action, RequestView
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()


def req(chain: tuple[int, ...], tokens: int | None = None) -> RequestView:
    return replace(request(tokens or 100 * len(chain)), chain=chain, chain_blocks=len(chain))


def test_defaults_are_the_binaries() -> None:
    assert (SGLANG.cache_threshold, SGLANG.balance_abs_threshold) == (0.3, 64)
    assert SGLANG.balance_rel_threshold == 1.5
    assert (SGLANG.max_tree_size, VLLM.max_tree_size) == (67_108_864, 33_554_432)


def test_imbalance_needs_both_thresholds_strictly() -> None:
    assert not imbalanced([0, 64], SGLANG)  # max − min = 64, not > 64
    assert imbalanced([0, 65], SGLANG)
    assert not imbalanced([130, 195], SGLANG)  # 65 > 64 but 195 = 1.5 · 130
    assert imbalanced([130, 196], SGLANG)


def test_balanced_cluster_follows_the_tree_imbalanced_takes_the_shortest_queue() -> None:
    sel = CacheAwareSelector(SGLANG, block_size=100)
    a, b = worker("a", Role.HYBRID), worker("b", Role.HYBRID)
    chain = tuple(range(10))
    assert sel.select([a, b], req(chain)).worker_id == "a"  # empty tree: least loaded, first
    busy_a = replace(a, running=60)
    assert sel.select([busy_a, b], req(chain)).worker_id == "a"  # 60 apart: still balanced
    very_busy_a = replace(a, running=65)
    assert sel.select([very_busy_a, b], req(chain)).worker_id == "b"  # 65 > 64, 65 > 1.5 · 0
    # the imbalanced choice was inserted too: b now holds the chain, last
    assert sel.tree.match(chain) == (10, "b")


def test_cache_threshold_is_strict() -> None:
    sel = CacheAwareSelector(SGLANG, block_size=100)
    a, b = worker("a", Role.HYBRID, running=1), worker("b", Role.HYBRID)
    sel.tree.insert((1, 2, 3), "a")
    # 3 of 10 blocks: match rate 0.3, not > 0.3 → the least loaded (b)
    assert sel.select([a, b], req((1, 2, 3, 4, 5, 6, 7, 8, 9, 10))).worker_id == "b"
    sel2 = CacheAwareSelector(SGLANG, block_size=100)
    sel2.tree.insert((1, 2, 3), "a")
    # 3 blocks of a 999-token prompt: 300 / 999 > 0.3 → the match (a), though busier
    assert sel2.select([a, b], req((1, 2, 3, 4, 5, 6, 7, 8, 9), 999)).worker_id == "a"


def test_a_matched_worker_outside_the_pool_falls_back_to_the_least_loaded() -> None:
    sel = CacheAwareSelector(SGLANG, block_size=100)
    sel.tree.insert((1, 2), "gone")
    pool = [worker("a", Role.HYBRID, running=2), worker("b", Role.HYBRID, running=1)]
    assert sel.select(pool, req((1, 2))).worker_id == "b"


def test_aggregated_policy_colocates_on_decode_capable_workers() -> None:
    pol = get_policy("sglang-cache-aware", UNIT_CONFIG, MODEL)
    assert isinstance(pol, CacheAwarePolicy)
    cl = cluster(worker("p0", Role.PREFILL), worker("h0", Role.HYBRID, running=1),
                 worker("d0", Role.DECODE, running=2))  # fmt: skip
    p = pol.plan(req((1, 2, 3)), cl)
    assert (p.chosen.prefill_worker, p.chosen.decode_worker) == ("h0", "h0")
    assert p.action is Action.COLOCATED_PREFILL
    # the same prefix goes back to h0 even when d0 is now as idle
    cl2 = cluster(worker("h0", Role.HYBRID, running=2), worker("d0", Role.DECODE, running=0))
    assert pol.plan(req((1, 2, 3, 4)), cl2).chosen.decode_worker == "h0"


def test_pd_policy_keeps_one_tree_per_pool() -> None:
    pol = get_policy("vllm-cache-aware-pd", UNIT_CONFIG, MODEL)
    cl = cluster(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL),
                 worker("d0", Role.DECODE), worker("d1", Role.DECODE))  # fmt: skip
    first = pol.plan(req((1, 2, 3)), cl)
    assert first.action is Action.REMOTE_PREFILL
    assert (first.chosen.prefill_worker, first.chosen.decode_worker) == ("p0", "d0")
    # p0 and d0 got busier, not imbalanced: the trees keep the prefix on both
    cl2 = cluster(worker("p0", Role.PREFILL, waiting=3), worker("p1", Role.PREFILL),
                  worker("d0", Role.DECODE, running=5), worker("d1", Role.DECODE))  # fmt: skip
    again = pol.plan(req((1, 2, 3, 4)), cl2)
    assert (again.chosen.prefill_worker, again.chosen.decode_worker) == ("p0", "d0")
