"""The approximate prefix tree the SGLang/vLLM models share, and the shared pickers."""

from __future__ import annotations

import random

from ownerserve.types import Role
from planner.policies.peers.common import ApproxTree, first_min, random_min
from tests.planner.util import worker


def test_tree_matches_the_longest_prefix_sent_and_its_longest_holder() -> None:
    t = ApproxTree(max_blocks=100)
    assert t.match((1, 2, 3)) == (0, None)
    t.insert((1, 2, 3), "a")
    t.insert((1, 2, 4), "b")
    assert t.match((1, 2, 3, 9)) == (3, "a")
    assert t.match((1, 2, 4)) == (3, "b")
    # both hold 1, 2: a had it first, and keeps it though b was sent it last
    assert t.match((1, 2, 5)) == (2, "a")
    t.insert((1, 2, 4), "b")
    assert t.match((1, 2)) == (2, "a")
    assert t.match((7,)) == (0, None)
    assert (t.size("a"), t.size("b")) == (3, 3)


def test_tree_trims_a_tenant_past_its_cap_oldest_tails_first() -> None:
    t = ApproxTree(max_blocks=16)
    t.insert(tuple(range(10)), "a")
    t.insert(tuple(range(100, 110)), "a")  # 20 > 16: trimmed to 15 (15/16 of the cap)
    assert t.size("a") == 15
    # the older chain lost its tail first and stays a prefix
    assert t.match(tuple(range(10))) == (5, "a")
    assert t.match(tuple(range(100, 110))) == (10, "a")
    t.insert((1000,), "b")
    assert t.size("b") == 1  # the cap is per tenant


def test_first_min_keeps_the_first_and_random_min_draws_among_ties() -> None:
    ws = [worker(f"w{i}", Role.HYBRID, running=r) for i, r in enumerate((3, 1, 1, 2))]
    assert first_min(ws, lambda w: w.running).worker_id == "w1"
    picks = {random_min(ws, lambda w: w.running, random.Random(s)).worker_id for s in range(30)}
    assert picks == {"w1", "w2"}
