"""The cost terms sized by the request's own KV spec (HeteroCache): a dense spec gives the
dense numbers, a hybrid one prices bytes, restores, fetches and migrations by its parts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.kvstate import KVStateSpec, SwaPolicy, load_spec
from ownerserve.profiles import load_profile
from ownerserve.types import Role, Tier
from planner.cost import CostConfig, CostModel, RequestCosts, Route, enumerate_routes, evaluate
from planner.policies.ownerserve import OwnerServePolicy
from planner.restore import plan_restore
from planner.types import Action, ClusterView, RequestView, WorkerView

H100 = load_profile("h100-llama3-8b")
LLAMA = load_spec("llama3-8b")
V4 = load_spec("deepseek-v4")
QWEN = load_spec("qwen3-8b-swa")
MODEL = CostModel(CostConfig(), {H100.name: H100})
V4_WINDOW = 61 * 128 * 576  # the windows at a boundary past 128 tokens


def _w(wid: str, role: Role = Role.HYBRID, node: str = "n0", **kw: object) -> WorkerView:
    return WorkerView(worker_id=wid, role=role, node=node, profile=H100.name, **kw)  # type: ignore[arg-type]


def _req(n: int, **kw: object) -> RequestView:
    base: dict[str, object] = {
        "model": "m",
        "prompt_tokens": n,
        "block_size": 128,
        "chain_blocks": n // 128,
        "max_tokens": 16,
        "kv_bytes_per_token": H100.kv_bytes_per_token,
    }
    base.update(kw)
    return RequestView(**base)  # type: ignore[arg-type]


def _cluster() -> tuple[ClusterView, WorkerView, WorkerView, WorkerView]:
    p0 = _w("p0", Role.PREFILL, "n0")
    d0 = _w("d0", Role.DECODE, "n0", running=3, cached_blocks={Tier.GPU: 40})
    d1 = _w("d1", Role.DECODE, "n1", cached_blocks={Tier.CPU: 60, Tier.GPU: 10})
    return ClusterView(workers=(p0, d0, d1)), p0, d0, d1


def test_a_dense_spec_gives_exactly_the_dense_numbers() -> None:
    cl, *_ = _cluster()
    plain = _req(8000, owner="d0", owner_blocks=40, session_owner="d0")
    dense = replace(plain, kv_spec=LLAMA)  # 131072 B a token, as the profile's K
    for route in enumerate_routes(plain, cl):
        a, b = evaluate(MODEL, plain, route), evaluate(MODEL, dense, route)
        if route.decode.worker_id == "d1":
            continue  # d1 restores from CPU: with a spec that is planned (below)
        assert (a.t_network, a.m_hbm_bytes, a.t_restore, a.total) == (
            b.t_network,
            b.m_hbm_bytes,
            b.t_restore,
            b.total,
        ), route


def test_hybrid_bytes_are_the_spec_s_sealed_rate_plus_the_state_that_moves() -> None:
    n = 8000
    k = RequestCosts(MODEL, _req(n, kv_spec=V4))
    mutable = V4.mutable_bytes(n)  # windows + the tail of 8000 % 4 and 8000 % 128 tokens
    assert mutable == V4_WINDOW + V4.tail_bytes(n)
    assert k.kv_to_decode(0) == n * 4969.5 + mutable
    assert k.kv_to_decode(40) == (n - 40 * 128) * 4969.5 + mutable
    assert k.prompt_copy(1280) == (n - 1280) * 4969.5 + mutable
    assert k.dup(True, 10) == 0  # no owner
    owned = RequestCosts(MODEL, _req(n, kv_spec=V4, owner="d0", owner_blocks=40))
    assert owned.dup(True, 10) == 30 * 128 * 4969.5
    # the pool of a worker that reports none: HBM over the spec's rate (26x the dense one)
    assert RequestCosts(MODEL, _req(n, kv_spec=V4)).k == V4.bytes_per_token()


def test_a_fetch_from_a_gpu_peer_moves_sealed_kv_and_the_destination_rebuilds_or_cuts_back() -> (
    None
):
    """A fetch brings the sealed blocks only (`FETCH_BRINGS_WINDOWS`): on arrival the
    destination rebuilds the windows at the moved boundary or resumes where its own are
    (`ownerserve.kvstate.resume`, hand-computed in tests/ownerserve/kvstate/test_resume.py)."""
    src, w = _w("s", node="n0"), _w("w", node="n0")
    k = RequestCosts(MODEL, _req(20_000, kv_spec=V4))
    # 100 blocks of 128 = 12800 tokens into a worker holding nothing: 12800 · 4969.5 B move,
    # and rebuilding 7808 tokens over 4992 (0.40262 s) beats computing all 12800 (0.618 s)
    tn, tr, nbytes = k.peer_restore(w, src, 0, 100)
    assert nbytes == 12800 * 4969.5 == 63_609_600
    assert tn == pytest.approx(2e-4 + 63_609_600 / 4e11)
    assert tr == pytest.approx(0.4026179584)
    assert k.resume_moved(w, 0, 100) == (100, pytest.approx(0.4026179584))
    # a worker holding 40 blocks with its windows there: computing [40, 100) (0.39666 s)
    # beats the rebuild, so the 60 moved blocks are not used and nothing is rebuilt
    w40 = _w("w40", node="n0", cached_blocks={Tier.GPU: 40}, restorable_blocks=40)
    assert k.resume_moved(w40, 40, 60) == (40, 0.0)
    assert k.peer_restore(w40, src, 40, 60)[1] == 0.0
    fetch = Route(Action.ARTIFACT_FETCH, w40, w40, src)
    owned = RequestCosts(MODEL, _req(20_000, kv_spec=V4, owner="s", owner_blocks=100))
    assert owned.candidate(fetch).reused_blocks == 40
    # without a spec: the dense bytes, nothing recomputed
    dense = RequestCosts(MODEL, _req(2000, block_size=16))
    assert dense.peer_restore(w, src, 0, 81) == pytest.approx(
        (2e-4 + 81 * 16 * 131072 / 4e11, 0.0, 81 * 16 * 131072)
    )


def test_a_gpu_hit_resumes_where_the_worker_s_windows_are_or_rebuilds_them() -> None:
    """The directory's restorable boundary on a worker (`WorkerView.restorable_blocks`) puts
    a hybrid GPU hit where the engine resumes it: its prefill starts there, or its
    T_restore carries the windows' rebuild; not known: at the sealed boundary, as before."""
    k = RequestCosts(MODEL, _req(20_000, kv_spec=V4))
    cut = _w("cut", cached_blocks={Tier.GPU: 100}, restorable_blocks=40)
    rebuilt = _w("rebuilt", cached_blocks={Tier.GPU: 100}, restorable_blocks=30)
    unknown = _w("unknown", cached_blocks={Tier.GPU: 100})
    terms = k.scan((cut, rebuilt, unknown))
    assert terms.resumed == [40, 100, 100] and terms.reused == [5120, 12800, 12800]
    assert terms.restore_s == [0.0, pytest.approx(0.4026179584), 0.0]
    for w in (cut, rebuilt, unknown):
        col = Route(Action.COLOCATED_PREFILL, w, w)
        assert k.candidate(col).reused_blocks == k.scan((w,)).resumed[0]
    # a dense spec ignores the windows
    dense = RequestCosts(MODEL, _req(20_000, block_size=16, kv_spec=LLAMA))
    assert dense.scan((cut,)).resumed == [100]


def test_a_worker_that_never_rebuilds_windows_resumes_at_its_restorable_boundary() -> None:
    """A vLLM worker (`WorkerView.rebuilds_windows` off) cuts a hybrid GPU hit back to the
    directory's restorable boundary even where a rebuild would be the cheaper, and the plan
    expects that much reuse of it, nothing rebuilt."""
    k = RequestCosts(MODEL, _req(20_000, kv_spec=V4))
    vllm = _w("vllm", cached_blocks={Tier.GPU: 100}, restorable_blocks=30, rebuilds_windows=False)
    cold = _w("cold", cached_blocks={Tier.GPU: 100}, restorable_blocks=0, rebuilds_windows=False)
    terms = k.scan((vllm, cold))
    assert terms.resumed == [30, 0] and terms.reused == [3840, 0]
    assert terms.restore_s == [0.0, 0.0]
    assert k.candidate(Route(Action.COLOCATED_PREFILL, vllm, vllm)).reused_blocks == 30


def test_every_restore_is_planned_with_the_request_s_spec_resident_prefix_included() -> None:
    w = _w("w", cached_blocks={Tier.GPU: 10, Tier.CPU: 60})
    spec = replace(V4, swa_policy=SwaPolicy.zero())
    k = RequestCosts(MODEL, _req(9000, kv_spec=spec))
    want = plan_restore(spec, 60 * 128, Tier.CPU, H100, resident_tokens=10 * 128)
    assert k.restore(w, 10, 60, 0) == pytest.approx(want.restore_s)
    # without the spec: the plain CPU load of the 50 blocks past the GPU prefix
    plain = RequestCosts(MODEL, _req(9000))
    assert plain.restore(w, 10, 60, 0) == pytest.approx(50 * 128 * 131072 / 5e10)


def test_a_hybrid_fetch_moves_a_fraction_of_the_dense_bytes_but_pays_the_window_rebuild() -> None:
    """A 100K-token prefix on a busy owner d0 (node n0); d1 on node n1 runs as many decodes
    (joining either batch costs its decodes the same, B) but queues nothing. With dense
    bytes (131072 B a token) the fetch moves 13.1 GB over the 25 GB/s inter-node link, 0.52 s,
    so the planner waits for d0; with the V4-like spec the same prefix is 0.5 GB of
    compressed KV, 0.02 s, but the fetch brings no windows: d1 rebuilds them over the last
    7808 tokens, prefill_s(7808, 92160) − base_s = 1.2874 s, and the planner still stays."""
    n = 100_000
    d0 = _w(
        "d0",
        Role.HYBRID,
        "n0",
        waiting=1,
        inflight_prefill_tokens=2000,
        running=5,
        cached_blocks={Tier.GPU: n // 128},
    )
    d1 = _w("d1", Role.HYBRID, "n1", running=5)
    cl = ClusterView(workers=(d0, d1))
    req = _req(n + 200, owner="d0", owner_blocks=n // 128, is_fork=True)
    policy = OwnerServePolicy(model=MODEL)
    dense_plan = policy.plan(req, cl)
    hybrid_plan = policy.plan(replace(req, kv_spec=V4), cl)
    assert dense_plan.action is Action.COLOCATED_PREFILL and dense_plan.chosen.decode_worker == "d0"
    assert hybrid_plan.action is Action.COLOCATED_PREFILL
    assert hybrid_plan.chosen.decode_worker == "d0"
    fetch = Route(Action.ARTIFACT_FETCH, d1, d1, d0)
    assert evaluate(MODEL, req, fetch).t_network > 0.5
    hybrid_fetch = evaluate(MODEL, replace(req, kv_spec=V4), fetch)
    assert hybrid_fetch.t_network < 0.03
    assert hybrid_fetch.t_restore == pytest.approx(1.2874080256)
    # the fork's default action is the fetch: the search costs it as the breakdown does
    assert hybrid_plan.default_action is Action.ARTIFACT_FETCH
    assert hybrid_plan.default_cost_s == pytest.approx(hybrid_fetch.total)


@pytest.mark.parametrize("spec", [V4, QWEN], ids=lambda s: s.name)
def test_the_search_resumes_hybrid_hits_as_the_reference_enumeration_does(
    spec: KVStateSpec,
) -> None:
    """Workers holding the prefix with their windows at various boundaries, a fetch source and
    a migration source: the policy's choice and its reused blocks are the cheapest of every
    route `evaluate` prices (the search's moves use `resume_moved` per worker)."""
    n = 30_000
    bs = 128 if spec is V4 else 16
    blocks = n // bs
    workers = (
        _w("a", cached_blocks={Tier.GPU: blocks}, restorable_blocks=blocks // 3, running=4),
        _w("b", cached_blocks={Tier.GPU: blocks // 2}, restorable_blocks=1, waiting=1),
        _w("c", node="n1", cached_blocks={Tier.GPU: blocks // 4}, restorable_blocks=blocks // 4),
        _w("d", node="n1"),
        _w("p", Role.PREFILL, cached_blocks={Tier.GPU: blocks // 2}, restorable_blocks=0),
    )
    cl = ClusterView(workers=workers)
    for owner, so in (("a", "b"), ("b", "a"), ("c", None)):
        req = _req(
            n + 100,
            block_size=bs,
            chain_blocks=blocks,
            owner=owner,
            owner_blocks=next(w for w in workers if w.worker_id == owner).cached_blocks[Tier.GPU],
            session_owner=so,
            kv_spec=spec,
        )
        plan = OwnerServePolicy(model=MODEL).plan(req, cl)
        k = RequestCosts(MODEL, req, cl)
        best = min((k.candidate(r) for r in enumerate_routes(req, cl)), key=lambda c: c.cost.total)
        assert plan.chosen.cost.total == pytest.approx(best.cost.total), (owner, so)
        route = Route(
            plan.chosen.action,
            next(w for w in workers if w.worker_id == plan.chosen.prefill_worker),
            next(w for w in workers if w.worker_id == plan.chosen.decode_worker),
            next((w for w in workers if w.worker_id == plan.chosen.source_worker), None),
        )
        assert plan.chosen.reused_blocks == k.candidate(route).reused_blocks
