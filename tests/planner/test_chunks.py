"""Chunk affinity: a worker holding a request's chunk KV prefills only the rest (plus the
re-rotation of what it copies), so the planner routes to the one holding the most of it."""

from __future__ import annotations

from dataclasses import replace

from ownerserve.profiles import load_profile
from ownerserve.types import Role, Tier
from planner.cost import CostModel, RequestCosts, enumerate_routes, evaluate
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
    # no chunk KV API anywhere: no chunk can be fetched, only reused where it is
    cluster = ClusterView(
        workers=(
            hybrid("none", chunk_api=False),
            hybrid("some", (0, 1, 2), chunk_api=False),
            hybrid("most", tuple(range(7)), chunk_api=False),
        )
    )
    plan = OwnerServePolicy(model=H100).plan(REQ, cluster)
    assert plan.chosen.decode_worker == "most"
    assert plan.chosen.prefill_worker == "most"
    assert plan.chosen.chunk_fetches == ()
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


# chunk fetch: REQ's 8 chunks, 4 held by each of two workers
HALF_A, HALF_B = (0, 1, 2, 3), (4, 5, 6, 7)


def test_a_worker_fetches_the_chunks_it_lacks_when_that_beats_computing_them() -> None:
    a, b = hybrid("a", HALF_A), hybrid("b", HALF_B)
    plan = OwnerServePolicy(model=H100).plan(REQ, ClusterView(workers=(a, b)))
    chosen = plan.chosen
    other = "b" if chosen.prefill_worker == "a" else "a"
    lacking = HALF_B if chosen.prefill_worker == "a" else HALF_A
    assert chosen.chunk_fetches == tuple((i, other) for i in lacking)
    # cheaper than computing them: the reuse of all 8 chunks plus the pull
    k = RequestCosts(H100, REQ, ClusterView(workers=(a, b)))
    w = a if chosen.prefill_worker == "a" else b
    assert chosen.cost.t_prefill < k._recompute(w, 0)


def test_the_fetch_is_priced_as_the_readme_writes_it() -> None:
    # holder on another node, behind 5 ms of NIC backlog; the destination's link 2x slower
    # than the profile and its hand-overs 20 ms over it
    a = hybrid("a", HALF_A, link_scale=2.0, handover_s=0.02, prefill_scale=1.5)
    b = hybrid("b", HALF_B, node="node1", nic_backlog_s=0.005)
    k = RequestCosts(H100, REQ, ClusterView(workers=(a, b)))
    fetched = k.chunk_fetch(a, 0)
    assert fetched is not None
    seconds, picks = fetched.prefill_s, fetched.fetches
    assert picks == tuple((i, "b") for i in HALF_B)
    link, pf = PROFILE.link, PROFILE.prefill
    nbytes = 4 * 512 * REQ.kv_bytes_per_token
    fetch_s = 2.0 * (link.latency_s + nbytes / link.inter_node_bps) + 0.005 + 0.02
    u = 8 * 512
    new, r = N - u, u
    prefill = 1.5 * (
        pf.base_s
        + pf.per_token_s * new
        + pf.per_token_ctx_s * new * (r + new / 2)
        + PROFILE.rerotate_per_token_s * u
    )
    assert abs(seconds - (fetch_s + prefill)) < 1e-12
    # prefill takes the lesser of that and computing the 4 chunks a lacks
    assert k.prefill(a, 0) == min(seconds, k._recompute(a, 0))


def test_chunks_are_recomputed_when_the_pull_costs_more() -> None:
    # a hand-over that costs a whole second on either worker: computing 2K tokens is cheaper
    a = hybrid("a", HALF_A, handover_s=1.0)
    b = hybrid("b", HALF_B, handover_s=1.0)
    plan = OwnerServePolicy(model=H100).plan(REQ, ClusterView(workers=(a, b)))
    assert plan.chosen.chunk_fetches == ()
    k = RequestCosts(H100, REQ, ClusterView(workers=(a, b)))
    assert plan.chosen.cost.t_prefill == k._recompute(
        a if plan.chosen.prefill_worker == "a" else b, 0
    )


def test_only_healthy_holders_with_a_chunk_api_are_fetched_from_and_only_into_a_chunk_api() -> None:
    for holder in (
        hybrid("b", HALF_B, chunk_api=False),
        hybrid("b", HALF_B, healthy=False),
    ):
        k = RequestCosts(H100, REQ, ClusterView(workers=(hybrid("a", HALF_A), holder)))
        assert k.chunk_fetch(hybrid("a", HALF_A), 0) is None
    k = RequestCosts(H100, REQ, ClusterView(workers=(hybrid("b", HALF_B),)))
    assert k.chunk_fetch(hybrid("a", HALF_A, chunk_api=False), 0) is None
    # a draining holder (a source only) still serves its chunks
    cluster = ClusterView(workers=(hybrid("a", HALF_A),), sources=(hybrid("b", HALF_B),))
    plan = OwnerServePolicy(model=H100).plan(REQ, cluster)
    assert plan.chosen.chunk_fetches == tuple((i, "b") for i in HALF_B)


def test_a_chunk_inside_the_reused_prefix_is_not_fetched() -> None:
    a, b = hybrid("a", HALF_A), hybrid("b", HALF_B)
    k = RequestCosts(H100, REQ, ClusterView(workers=(a, b)))
    r = 100 + 6 * 512  # a's prefix covers chunks 0-5
    fetched = k.chunk_fetch(a, r)
    assert fetched is not None and fetched.fetches == ((6, "b"), (7, "b"))


def test_the_search_matches_the_reference_when_chunks_can_be_fetched() -> None:
    # the policy's choice is the argmin over every route `evaluate` prices with the cluster
    for hand in (0.0, 0.01, 0.2):
        for busy in (0, 40, 200):
            for node_b in ("node0", "node1"):
                cluster = ClusterView(
                    workers=(
                        hybrid("a", HALF_A, running=busy, handover_s=hand),
                        hybrid("b", HALF_B, node=node_b, handover_s=hand),
                        hybrid("c", (), running=busy // 2),
                        WorkerView(worker_id="p", role=Role.PREFILL, chunks_held=(1, 5)),
                    )
                )
                plan = OwnerServePolicy(model=H100).plan(REQ, cluster)
                best = min(
                    evaluate(H100, REQ, r, cluster).total for r in enumerate_routes(REQ, cluster)
                )
                assert abs(plan.chosen.cost.total - best) <= 1e-9 * max(1.0, best)
