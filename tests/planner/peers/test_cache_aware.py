"""The SGLang/vLLM `cache_aware` rule at its thresholds (balance 64 / 1.5, cache 0.3) and where
the binaries depart from it: vllm-router skips its tree for tool turns, sglang-router's P/D mode
picks at random."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from ownerserve.types import Role
from planner.policies import get_policy
from planner.policies.peers.cache_aware import (
    SGLANG,
    VLLM,
    AgentTraffic,
    CacheAwarePDPolicy,
    CacheAwarePolicy,
    CacheAwareSelector,
    VllmCacheAwarePolicy,
    imbalanced,
    match_rate,
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
    # the imbalanced choice was inserted too: b now holds the chain, a has held it longer
    assert sel.tree.size("b") == 10 and sel.tree.match(chain) == (10, "a")


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


def test_vllm_routes_a_tool_turn_to_the_least_loaded_without_its_tree() -> None:
    """vllm-router 0.1.17 counts a chat request with tool messages as `missing_tokens`: the
    least loaded worker (the first of equals), and the tree does not learn it."""
    assert VLLM.tree_skips_tool_turns and not SGLANG.tree_skips_tool_turns
    chain = (1, 2, 3, 4)
    a, b = worker("a", Role.HYBRID, running=1), worker("b", Role.HYBRID)
    turn = replace(req(chain), previous_prompt_tokens=300)  # a continuation: a tool result
    sglang = CacheAwareSelector(SGLANG, block_size=100)
    sglang.tree.insert(chain, "a")
    assert sglang.select([a, b], turn).worker_id == "a"  # the tree's full match
    vllm = CacheAwareSelector(VLLM, block_size=100)
    vllm.tree.insert(chain, "a")
    assert vllm.select([a, b], turn).worker_id == "b"  # the least loaded
    assert vllm.tree.size("b") == 0  # not recorded
    # a first turn (no tool messages) still follows the tree
    assert vllm.select([a, b], req(chain)).worker_id == "a"


@dataclass(frozen=True)
class Told:
    """A `RoutingText` that knows the request bodies: which prompt lengths carry tools, and the
    routing text's bytes per block."""

    tools: frozenset[int] = frozenset()
    content: tuple[tuple[int, ...], int] | None = None

    def carries_tools(self, request: RequestView) -> bool:
        return request.prompt_tokens in self.tools

    def content_bytes(self, request: RequestView) -> tuple[Sequence[int], int] | None:
        return self.content


def test_tool_turns_can_be_told_exactly() -> None:
    default = AgentTraffic()
    assert default.carries_tools(replace(req((1,)), previous_prompt_tokens=1))
    assert not default.carries_tools(req((1,)))
    pol = VllmCacheAwarePolicy(UNIT_CONFIG, MODEL, text=Told(frozenset({777})))
    cl = cluster(worker("h0", Role.HYBRID, running=1), worker("h1", Role.HYBRID))
    pol.plan(req((1, 2, 3)), cl)  # tree: h1 (least loaded) holds the chain
    busy_h1 = cluster(worker("h0", Role.HYBRID), worker("h1", Role.HYBRID, running=1))
    assert pol.plan(req((1, 2, 3, 4)), busy_h1).chosen.decode_worker == "h1"  # the tree
    assert pol.plan(req((1, 2, 3, 4), 777), busy_h1).chosen.decode_worker == "h0"  # a tool turn


def test_match_rate_counts_the_routing_texts_bytes_when_known() -> None:
    """The HTTP routers match the messages' contents, not the template or the tool-call JSON:
    3 matched blocks of a 1000-token prompt are 0.3 of its tokens, but here 400 of the text's
    500 bytes."""
    request = req((1, 2, 3, 4, 5), 1000)
    assert match_rate(request, 3, AgentTraffic()) == pytest.approx(0.3)
    text = Told(content=((0, 150, 300, 400, 450, 500), 500))
    assert match_rate(request, 3, text) == pytest.approx(0.8)
    sel = CacheAwareSelector(SGLANG, block_size=100, text=text)
    a, b = worker("a", Role.HYBRID, running=1), worker("b", Role.HYBRID)
    sel.tree.insert((1, 2, 3), "a")
    # 0.3 of the tokens would not pass the 0.3 threshold; 0.8 of the text does
    assert sel.select([a, b], request).worker_id == "a"
    assert CacheAwareSelector(SGLANG, block_size=100).select([a, b], request).worker_id == "b"


def test_sglang_pd_finds_no_tree_and_picks_at_random() -> None:
    """sglang-router 0.3.2's P/D mode looks its trees up under a model key they were not built
    under: "No tree found ..., using random worker selection" on both sides."""
    assert not SGLANG.pd_tree_found and VLLM.pd_tree_found
    cl = cluster(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL),
                 worker("d0", Role.DECODE), worker("d1", Role.DECODE))  # fmt: skip
    picks = [
        get_policy("sglang-cache-aware-pd", UNIT_CONFIG, MODEL).plan(req((1, 2, 3)), cl).chosen
        for _ in range(2)
    ]
    assert picks[0] == picks[1]  # seeded: runs repeat
    pol = CacheAwarePDPolicy(UNIT_CONFIG, MODEL, seed=1)
    pairs = {
        (r.chosen.prefill_worker, r.chosen.decode_worker)
        for r in (pol.plan(req((1, 2, 3)), cl) for _ in range(40))
    }
    # one prompt, every pairing: no tree keeps it anywhere
    assert pairs == {("p0", "d0"), ("p0", "d1"), ("p1", "d0"), ("p1", "d1")}
    assert pol._prefill is None and pol._decode is None
