"""llm-d's default scorers (prefix 3, queue 2, KV 2), max-score pick and P/D threshold."""

from __future__ import annotations

import pytest

from ownerserve.types import Role
from planner.policies import get_policy
from planner.policies.peers.llm_d import LlmDConfig, queue_scores, scores
from planner.types import Action
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()


def test_queue_scorer_normalises_between_min_and_max() -> None:
    ws = [worker(f"w{q}", Role.HYBRID, waiting=q) for q in (0, 2, 4)]
    assert queue_scores(ws) == [1.0, 0.5, 0.0]
    assert queue_scores(ws[1:2] * 3) == [1.0, 1.0, 1.0]


def test_weighted_score_and_max_score_pick() -> None:
    pool = [
        worker("a", Role.HYBRID, gpu=10, waiting=4, kv_usage=0.5),  # 3·1 + 2·0 + 2·0.5 = 4
        worker("b", Role.HYBRID, waiting=0, kv_usage=0.1),  # 0 + 2·1 + 2·0.9 = 3.8
        worker("c", Role.HYBRID, gpu=5, waiting=2),  # 3·0.5 + 2·0.5 + 2·1 = 4.5
    ]
    s = scores(pool, request(1000), LlmDConfig())
    assert s == pytest.approx({"a": 4.0, "b": 3.8, "c": 4.5})
    p = get_policy("llm-d", UNIT_CONFIG, MODEL).plan(request(1000), cluster(*pool))
    assert (p.chosen.prefill_worker, p.chosen.decode_worker) == ("c", "c")


def test_pd_prefills_remotely_only_from_the_threshold() -> None:
    pol = get_policy("llm-d-pd", UNIT_CONFIG, MODEL)
    # the decode pod holds 20 of 40.47 blocks: 2047 tokens uncached, one under the threshold
    cl = cluster(worker("p0", Role.PREFILL), worker("d0", Role.DECODE, gpu=20))
    local = pol.plan(request(4047), cl)
    assert (local.action, local.chosen.prefill_worker) == (Action.COLOCATED_PREFILL, "d0")
    remote = pol.plan(request(4048), cl)
    assert (remote.action, remote.chosen.prefill_worker, remote.chosen.decode_worker) == (
        Action.REMOTE_PREFILL, "p0", "d0",
    )  # fmt: skip
