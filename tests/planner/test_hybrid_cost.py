"""The cost terms sized by the request's own KV spec (HeteroCache): a dense spec gives the
dense numbers, a hybrid one prices bytes, restores, fetches and migrations by its parts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.kvstate import SwaPolicy, load_spec
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


def test_a_fetch_from_a_gpu_peer_loads_sealed_kv_and_windows_and_recomputes_the_tail() -> None:
    src, w = _w("s", node="n0"), _w("w", node="n0")
    k = RequestCosts(MODEL, _req(2000, block_size=16, kv_spec=V4))
    # 81 blocks of 16 = 1296 tokens: sealed 1280 (+ windows there) load, 16 are recomputed
    tn, tr, nbytes = k.peer_restore(w, src, 0, 81)
    assert nbytes == 1280 * 4969.5 + V4_WINDOW == 10_858_368
    assert tn == pytest.approx(2e-4 + 10_858_368 / 4e11)
    assert tr == pytest.approx(H100.prefill_s(16, 1280))
    # without a spec: the dense bytes, nothing recomputed
    dense = RequestCosts(MODEL, _req(2000, block_size=16))
    assert dense.peer_restore(w, src, 0, 81) == pytest.approx(
        (2e-4 + 81 * 16 * 131072 / 4e11, 0.0, 81 * 16 * 131072)
    )


def test_every_restore_is_planned_with_the_request_s_spec_resident_prefix_included() -> None:
    w = _w("w", cached_blocks={Tier.GPU: 10, Tier.CPU: 60})
    spec = replace(V4, swa_policy=SwaPolicy.zero())
    k = RequestCosts(MODEL, _req(9000, kv_spec=spec))
    want = plan_restore(spec, 60 * 128, Tier.CPU, H100, resident_tokens=10 * 128)
    assert k.restore(w, 10, 60, 0) == pytest.approx(want.restore_s)
    # without the spec: the plain CPU load of the 50 blocks past the GPU prefix
    plain = RequestCosts(MODEL, _req(9000))
    assert plain.restore(w, 10, 60, 0) == pytest.approx(50 * 128 * 131072 / 5e10)


def test_the_hybrid_aware_planner_fetches_where_dense_bytes_would_recompute() -> None:
    """A 100K-token prefix on a busy owner d0 (node n0); d1 on node n1 is idle. With dense
    bytes (131072 B a token) the fetch moves 13.1 GB over the 25 GB/s inter-node link, 0.52 s,
    (+0.13 s of λ·M_HBM for the replica), so the planner waits for d0 (0.52 s with its queue
    and the 5 decodes it stalls, against 0.87 s); with the V4-like spec the same prefix is
    0.5 GB of compressed KV and windows, 0.02 s, and the fetch wins (0.24 s)."""
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
    d1 = _w("d1", Role.HYBRID, "n1")
    cl = ClusterView(workers=(d0, d1))
    req = _req(n + 200, owner="d0", owner_blocks=n // 128, is_fork=True)
    policy = OwnerServePolicy(model=MODEL)
    dense_plan = policy.plan(req, cl)
    hybrid_plan = policy.plan(replace(req, kv_spec=V4), cl)
    assert dense_plan.action is Action.COLOCATED_PREFILL and dense_plan.chosen.decode_worker == "d0"
    assert hybrid_plan.action is Action.ARTIFACT_FETCH and hybrid_plan.chosen.decode_worker == "d1"
    fetch = Route(Action.ARTIFACT_FETCH, d1, d1, d0)
    assert evaluate(MODEL, req, fetch).t_network > 0.5
    assert evaluate(MODEL, replace(req, kv_spec=V4), fetch).t_network < 0.03
    # the search's cost is the breakdown's
    assert hybrid_plan.chosen.cost.total == pytest.approx(
        evaluate(MODEL, replace(req, kv_spec=V4), fetch).total
    )
