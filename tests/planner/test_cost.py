"""Each cost term pinned with hand-computed numbers (round-number profile in `util.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.config import PlannerSettings
from ownerserve.errors import ConfigError
from ownerserve.kvstate import load_spec
from ownerserve.types import Role, Tier
from planner.cost import (
    CostConfig,
    CostModel,
    Route,
    enumerate_routes,
    evaluate,
    i_decode,
    m_hbm,
    t_compute,
    t_decode,
    t_network,
    t_prefill,
    t_queue,
    t_restore,
)
from planner.restore import plan_restore
from planner.types import Action
from tests.planner.util import UNIT, UNIT_CONFIG, cluster, example, request, unit_model, worker

M = unit_model()


def _routes() -> dict[tuple[str, str, str], Route]:
    req, cl = example()
    return {
        (r.action.value, r.prefill.worker_id, r.decode.worker_id): r
        for r in enumerate_routes(req, cl)
    }


def test_primitives_scale_with_calibration() -> None:
    w = worker("h", Role.HYBRID, prefill_scale=1.5, decode_scale=2.0, link_scale=3.0)
    # 1.5 · (0.01 + 1e-4·400 + 1e-8·400·(600 + 200)) = 1.5 · 0.0532
    assert M.prefill_s(w, 400, 600) == pytest.approx(0.0798)
    # 2 · (0.005 + 1e-4·21 + 1e-8·101000)
    assert M.decode_step_s(w, 21, 101_000) == pytest.approx(0.01622)
    assert M.decode_step_s(w, 0, 5) == 0.0
    other = worker("x", Role.DECODE, "node1")
    # 3 · (1e-3 + 6e5 / 1e10) into w across nodes
    assert M.transfer_s(other, w, 6e5) == pytest.approx(0.00318)
    # into `other` (link scale 1) on the same node would be 1e-3 + 6e5/1e11
    assert M.transfer_s(w, replace(other, node="node0"), 6e5) == pytest.approx(0.001006)
    assert M.transfer_s(other, w, 0) == 0.0
    # 3e5 / 1e9 + 3e5 / 1e8
    assert M.restore_s(w, 3e5, 3e5) == pytest.approx(0.0033)
    # 1.5 · (1e-4 · 2000 + 0.01 · 3)
    assert M.queue_s(replace(w, inflight_prefill_tokens=2000, waiting=3)) == pytest.approx(0.345)
    assert M.context_tokens(replace(w, kv_usage=0.25)) == pytest.approx(250_000)


def test_colocated_on_the_busy_owner_term_by_term() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d0", "d0")]
    assert t_queue(M, req, r) == pytest.approx(0.01)  # 0.01 · 1 waiting
    assert t_prefill(M, req, r) == pytest.approx(0.0532)  # 400 new on 600 cached
    assert t_decode(M, req, r) == pytest.approx(0.0811)  # 10 · (0.005 + 1e-4·21 + 1e-8·101000)
    assert t_compute(M, req, r) == pytest.approx(0.1343)
    assert t_network(M, req, r) == 0.0
    assert t_restore(M, req, r) == 0.0
    assert m_hbm(M, req, r) == 0.0  # d0 owns the prefix
    assert i_decode(M, req, r) == pytest.approx(0.01064)  # 0.0532 · 20/100
    b = evaluate(M, req, r)
    assert b.total == pytest.approx(0.15494)
    assert b.t_decode_step == pytest.approx(0.00811)
    assert (b.lam, b.mu) == (1e-9, 1.0)


def test_colocated_on_a_non_owner_pays_for_the_duplicate() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d1", "d1")]
    b = evaluate(M, req, r)
    assert b.t_prefill == pytest.approx(0.115)  # 0.01 + 0.1 + 1e-8·1000·500
    assert b.t_compute == pytest.approx(0.2661)  # + 10 · (0.005 + 1e-4·51 + 1e-8·501000)
    assert b.m_hbm_bytes == 600_000  # 6 owned blocks · 100 tokens · 1000 B recomputed on d1
    assert b.i_decode == pytest.approx(0.0575)  # 0.115 · 50/100
    assert b.total == pytest.approx(0.3242)


def test_remote_prefill_same_node_moves_only_what_d_lacks() -> None:
    req, _ = example()
    r = _routes()[("remote_prefill", "p0", "d0")]
    b = evaluate(M, req, r)
    assert b.t_queue == pytest.approx(0.01)  # q(p0) = 0 + q(d0) = 0.01
    assert b.t_compute == pytest.approx(0.1961)  # 0.115 on p0 + 0.0811 on d0
    # handshake 0.002 + 1e-3 + (1000 − 600 tokens)·1000 B / 1e11
    assert b.t_network == pytest.approx(0.003004)
    assert b.m_hbm_bytes == 1_000_000  # p0's transient copy of all 1000 tokens
    assert b.i_decode == 0.0
    assert b.total == pytest.approx(0.210104)


def test_remote_prefill_across_nodes_to_a_non_owner() -> None:
    req, _ = example()
    b = evaluate(M, req, _routes()[("remote_prefill", "p0", "d1")])
    assert b.t_network == pytest.approx(0.0031)  # 0.002 + 1e-3 + 1e6 / 1e10
    assert b.m_hbm_bytes == 1_600_000  # 1e6 transient on p0 + 6e5 owned prefix now on d1
    assert b.total == pytest.approx(0.2708)


def test_state_migration_moves_the_owner_blocks_without_a_duplicate() -> None:
    req, _ = example()
    b = evaluate(M, req, _routes()[("state_migration", "d1", "d1")])
    assert b.t_prefill == pytest.approx(0.0532)  # d1 reuses the 600 moved tokens
    assert b.t_network == pytest.approx(0.00106)  # 1e-3 + 6e5 / 1e10
    assert b.m_hbm_bytes == 0.0
    assert b.i_decode == pytest.approx(0.0266)  # 0.0532 · 50/100
    assert b.total == pytest.approx(0.23196)


def test_artifact_fetch_creates_a_replica() -> None:
    req = request(1000, owner="d0", owner_blocks=6, is_fork=True)
    cl = cluster(worker("d0", Role.DECODE, gpu=6), worker("d1", Role.DECODE, "node1"))
    routes = enumerate_routes(req, cl)
    fetch = [r for r in routes if r.action is Action.ARTIFACT_FETCH]
    assert [(r.source.worker_id, r.decode.worker_id) for r in fetch] == [("d0", "d1")]  # type: ignore[union-attr]
    b = evaluate(M, req, fetch[0])
    assert b.t_network == pytest.approx(0.00106)
    assert b.m_hbm_bytes == 600_000
    assert b.t_compute == pytest.approx(0.0532 + 0.0511)  # 10 · (0.005 + 1e-4 + 1e-8·1000)
    assert b.total == pytest.approx(0.10596)


def test_restore_loads_cpu_and_ssd_parts_beyond_the_gpu_prefix() -> None:
    req = request(1000)
    w = worker("d0", Role.DECODE, gpu=2, cpu=5, ssd=8)
    r = Route(Action.TAIL_RECOMPUTE, w, w)
    # CPU blocks 2..5: 3·100·1000 B / 1e9; SSD blocks 5..8: 3e5 / 1e8
    assert t_restore(M, req, r) == pytest.approx(0.0033)
    assert t_prefill(M, req, r) == pytest.approx(0.01 + 0.02 + 1e-8 * 200 * 900)  # 800 reused
    # the whole prompt cached: the last token is still computed
    w9 = worker("d0", Role.DECODE, gpu=10)
    assert t_prefill(M, req, Route(Action.COLOCATED_PREFILL, w9, w9)) == pytest.approx(
        0.01 + 1e-4 + 1e-8 * 1 * 999.5
    )


def test_cold_restore_uses_the_restore_planner_when_a_kv_spec_is_configured() -> None:
    spec = load_spec("llama3-8b")
    model = CostModel(replace(UNIT_CONFIG, kv_spec="llama3-8b"), {"unit": UNIT})
    req = request(1050)
    w = worker("d0", Role.DECODE, cpu=10)
    expected = plan_restore(spec, 1000, Tier.CPU, UNIT).restore_s
    assert expected > 0
    assert t_restore(model, req, Route(Action.TAIL_RECOMPUTE, w, w)) == pytest.approx(expected)
    # with part of the prefix in GPU, the plain tier load applies
    w2 = worker("d0", Role.DECODE, gpu=4, cpu=10)
    assert t_restore(model, req, Route(Action.TAIL_RECOMPUTE, w2, w2)) == pytest.approx(6e5 / 1e9)


def test_decode_horizon_caps_the_counted_decode_steps() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d0", "d0")]
    assert t_decode(M, replace(req, max_tokens=2), r) == pytest.approx(2 * 0.00811)
    assert t_decode(M, replace(req, max_tokens=10_000), r) == pytest.approx(10 * 0.00811)


def test_config_from_settings_and_bad_configs() -> None:
    cfg = CostConfig.from_settings(PlannerSettings(lambda_hbm=2e-11, mu_interference=0.5))
    assert (cfg.lam, cfg.mu, cfg.profile, cfg.kv_spec) == (2e-11, 0.5, "h100-llama3-8b", None)
    cfg = CostConfig.from_settings(PlannerSettings(), kv_spec="llama3-8b")
    assert CostModel(cfg).spec is not None
    with pytest.raises(ConfigError):
        CostConfig(lam=-1.0)
    with pytest.raises(ConfigError):
        CostModel(CostConfig(profile="missing"), {"unit": UNIT})
    with pytest.raises(ConfigError):
        CostModel(CostConfig(profile="no-such-profile-file"))
    slow_intra = replace(UNIT, link=replace(UNIT.link, intra_node_bps=1e9))
    with pytest.raises(ConfigError, match="intra_node_bps"):
        CostModel(UNIT_CONFIG, {"unit": slow_intra})
    for bad in (
        replace(UNIT, max_num_seqs=0),
        replace(UNIT, kv_bytes_per_token=0),
        replace(UNIT, link=replace(UNIT.link, ssd_load_bps=0.0)),
    ):
        with pytest.raises(ConfigError, match="must be > 0"):
            CostModel(UNIT_CONFIG, {"unit": bad})


def test_unknown_worker_profile_falls_back_to_the_default() -> None:
    w = replace(worker("d0", Role.DECODE), profile="nope")
    assert M.profile_of(w) is UNIT
    assert CostModel().profile_of(w).name == "h100-llama3-8b"


def test_enumeration_skips_unhealthy_workers_and_self_pairs() -> None:
    req = request(1000)
    cl = cluster(
        worker("h0", Role.HYBRID),
        worker("h1", Role.HYBRID, healthy=False),
        worker("p0", Role.PREFILL),
    )
    got = sorted(
        (r.action.value, r.prefill.worker_id, r.decode.worker_id) for r in enumerate_routes(req, cl)
    )
    assert got == [("colocated_prefill", "h0", "h0"), ("remote_prefill", "p0", "h0")]
