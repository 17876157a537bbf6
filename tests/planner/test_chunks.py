"""Chunk affinity: a worker holding a request's chunk KV prefills only the rest (plus the
re-rotation of what it copies), so the planner routes to the one holding the most of it."""

from __future__ import annotations

from dataclasses import replace

from ownerserve.profiles import load_profile
from ownerserve.types import Role, Tier
from planner.cost import CostModel, RequestCosts
from planner.policies import OwnerServePolicy
from planner.types import ClusterView, RequestView, WorkerView

H100 = CostModel()
PROFILE = load_profile("h100-llama3-8b")
# a RAG prompt: 100 system tokens, 8 chunks of 512, a 50-token question
SPANS = tuple((100 + 512 * i, 100 + 512 * (i + 1)) for i in range(8))
N = 100 + 8 * 512 + 50
REQ = RequestView(
    model="m", prompt_tokens=N, block_size=16, chain_blocks=N // 16, chunk_spans=SPANS
)


def hybrid(wid: str, chunks: tuple[int, ...] = (), **kw: object) -> WorkerView:
    return WorkerView(worker_id=wid, role=Role.HYBRID, chunks_held=chunks, **kw)  # type: ignore[arg-type]


def test_the_worker_holding_most_chunk_kv_wins() -> None:
    cluster = ClusterView(
        workers=(hybrid("none"), hybrid("some", (0, 1, 2)), hybrid("most", tuple(range(7))))
    )
    plan = OwnerServePolicy(model=H100).plan(REQ, cluster)
    assert plan.chosen.decode_worker == "most"
    assert plan.chosen.prefill_worker == "most"
    # the runner-up prefills there too (and hands over to another decode worker)
    assert plan.runner_up is not None and plan.runner_up.prefill_worker == "most"


def test_the_prefill_term_is_the_readme_formula() -> None:
    k = RequestCosts(H100, REQ)
    w = hybrid("w", (0, 3, 7))
    u = 3 * 512
    assert k.chunk_reuse(w, 0) == u
    pf = PROFILE.prefill
    new, r = N - u, u
    expected = (
        pf.base_s + pf.per_token_s * new + pf.per_token_ctx_s * new * (r + new / 2)
    ) + PROFILE.rerotate_per_token_s * u
    plan = OwnerServePolicy(model=H100).plan(REQ, ClusterView(workers=(w,)))
    assert abs(plan.chosen.cost.t_prefill - expected) < 1e-12
    # cheaper than computing the whole prompt
    assert plan.chosen.cost.t_prefill < 0.7 * k.prefill(hybrid("x"), 0)


def test_chunks_inside_the_held_prefix_are_not_counted_twice() -> None:
    k = RequestCosts(H100, REQ)
    w = hybrid("w", (0, 1))
    assert k.chunk_reuse(w, 0) == 1024
    assert k.chunk_reuse(w, 100 + 512 + 256) == 256  # chunk 0 in the prefix, half of 1
    assert k.chunk_reuse(w, 100 + 1024) == 0
    # the last prompt token is always computed
    tail = replace(REQ, chunk_spans=((0, N),))
    assert RequestCosts(H100, tail).chunk_reuse(hybrid("t", (0,)), 0) == N - 1


def test_a_held_prefix_and_held_chunks_add_up() -> None:
    prefix = hybrid("prefix", cached_blocks={Tier.GPU: (100 + 512) // 16})  # sys + chunk 0
    both = hybrid("both", (1, 2, 3), cached_blocks={Tier.GPU: (100 + 512) // 16})
    plan = OwnerServePolicy(model=H100).plan(REQ, ClusterView(workers=(prefix, both)))
    assert plan.chosen.decode_worker == "both"
    assert plan.chosen.reused_blocks == (100 + 512) // 16
