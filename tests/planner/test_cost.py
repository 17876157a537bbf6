"""Each cost term pinned with hand-computed numbers (round-number profile in `util.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.config import PlannerSettings
from ownerserve.errors import ConfigError
from ownerserve.kvstate import load_spec
from ownerserve.types import Role, Tier
from planner.cost import (
    KV_NEVER_S,
    PROGRAMS_CLOSED_S,
    CostConfig,
    CostModel,
    RequestCosts,
    Route,
    enumerate_routes,
    evaluate,
)
from planner.policies.ownerserve import OwnerServePolicy
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


def test_per_worker_terms_scale_with_calibration() -> None:
    w = worker("h", Role.HYBRID, prefill_scale=1.5, decode_scale=2.0, link_scale=3.0)
    k = RequestCosts(M, request(1000))  # N = 1000, O = 10
    # 1.5 · (0.01 + 1e-4·400 + 1e-8·400·(600 + 200)) = 1.5 · 0.0532
    assert k.prefill(w, 600) == pytest.approx(0.0798)
    busy = replace(w, running=20, kv_usage=0.1, inflight_prefill_tokens=2000, waiting=3)
    terms = k.worker(busy)
    assert terms.worker is busy
    assert terms.queue_s == pytest.approx(0.345)  # 1.5 · (1e-4 · 2000 + 0.01 · 3)
    # B: what joining its batch costs the 20 decodes running there, 2 · 20 · 10 · (1e-4 +
    # 1e-8·1000); the decode column is 2 · 10 · (0.005 + 1e-4·21 + 1e-8·(0.1 · 1e6 + 1000))
    # + μ·B, μ = 1
    assert k.batch_s(busy) == pytest.approx(0.044)
    assert terms.decode_s == pytest.approx(0.1622 + 0.044)
    assert k.batch_s(replace(busy, role=Role.PREFILL)) == 0.0
    assert k.batch_s(w) == 0.0  # nothing running there
    # all 1000 tokens on nothing
    assert terms.prefill_s == pytest.approx(1.5 * 0.115) and terms.stalled == 20
    assert terms.held is None
    assert k.worker(replace(busy, role=Role.PREFILL)).stalled == 0  # a P worker stalls no decode
    other = worker("x", Role.DECODE, "node1")
    # 3 · (1e-3 + 6e5 / 1e10) into w across nodes
    assert k.transfer_s(other, w, 6e5) == pytest.approx(0.00318)
    assert k.nic_s(other, w, 6e5) == pytest.approx(0.00318)  # it crosses other's NIC
    # into `other` (link scale 1) on the same node would be 1e-3 + 6e5/1e11, no NIC crossed
    near = replace(other, node="node0")
    assert k.transfer_s(w, near, 6e5) == pytest.approx(0.001006) and k.nic_s(w, near, 6e5) == 0.0
    assert k.transfer_s(other, w, 0) == 0.0 and k.nic_s(other, w, 0) == 0.0
    # 3 blocks from CPU, 3 more from SSD: 3e5 / 1e9 + 3e5 / 1e8
    assert k.restore(w, 0, 3, 6) == pytest.approx(0.0033)
    assert k.restore(w, 6, 3, 6) == 0.0  # the GPU copy is the longest
    assert k.hysteresis(1.0) == pytest.approx(0.15)  # 0.05 + 0.1 · 1


def test_a_transfer_between_nodes_waits_for_the_source_nodes_nic_backlog() -> None:
    src = worker("s", Role.DECODE, "node1", nic_backlog_s=0.25)
    dst = worker("d", Role.DECODE, "node0", nic_backlog_s=7.0)
    k = RequestCosts(M, request(1000))
    # the source's backlog, then 1e-3 + 6e5 / 1e10; the destination's own backlog is not paid
    assert k.transfer_s(src, dst, 6e5) == pytest.approx(0.25106)
    # the other way round waits for d's NIC
    assert k.transfer_s(dst, src, 6e5) == pytest.approx(7.00106)
    # within a node no NIC is crossed; nothing moved waits for nothing
    assert k.transfer_s(src, replace(dst, node="node1"), 6e5) == pytest.approx(0.001006)
    assert k.transfer_s(src, dst, 0) == 0.0


def test_colocated_on_the_busy_owner_term_by_term() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d0", "d0")]
    b = evaluate(M, req, r)
    assert b.t_queue == pytest.approx(0.01)  # 0.01 · 1 waiting
    assert b.t_prefill == pytest.approx(0.0572)  # 0.01 + 0.04 + 1e-8·400·(1600 + 200)
    # decode: 10 · (0.005 + 1e-4·3 + 1e-8·102000)
    assert b.t_compute - b.t_prefill == pytest.approx(0.0632)
    assert b.t_compute == pytest.approx(0.1204)
    assert b.t_network == 0.0
    assert b.t_restore == 0.0
    assert b.m_hbm_bytes == 0.0  # d0 owns the prefix
    # both running decodes wait 0.0572, and each steps with one more sequence of 2000 tokens'
    # context for the 10 steps counted: B(d0) = 2 · 10 · (1e-4 + 1e-8·2000) = 0.0024
    assert b.i_decode == pytest.approx(0.1168)  # 2 · 0.0572 + 0.0024
    assert b.h_move == 0.0
    assert b.total == pytest.approx(0.2472)
    assert b.t_decode_step == pytest.approx(0.00632)
    assert (b.lam, b.mu) == (1e-9, 1.0)


def test_colocated_on_a_non_owner_pays_for_the_duplicate() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d1", "d1")]
    b = evaluate(M, req, r)
    assert b.t_prefill == pytest.approx(0.23)  # 0.01 + 0.2 + 1e-8·2000·1000
    assert b.t_compute == pytest.approx(0.3322)  # + 10 · (0.005 + 1e-4·2 + 1e-8·502000)
    assert b.m_hbm_bytes == 1_600_000  # 16 owned blocks · 100 tokens · 1000 B recomputed on d1
    # d1's one running decode waits the whole prefill; B(d1) = 1 · 10 · (1e-4 + 1e-8·2000)
    assert b.i_decode == pytest.approx(0.2312)  # 0.23 + 0.0012
    assert b.total == pytest.approx(0.565)


def test_remote_prefill_same_node_moves_only_what_d_lacks() -> None:
    req, _ = example()
    r = _routes()[("remote_prefill", "p0", "d0")]
    b = evaluate(M, req, r)
    assert b.t_queue == pytest.approx(0.01)  # q(p0) = 0 + q(d0) = 0.01
    assert b.t_compute == pytest.approx(0.2932)  # 0.23 on p0 + 0.0632 on d0
    # handshake 0.002 + 1e-3 + (2000 − 1600 tokens)·1000 B / 1e11
    assert b.t_network == pytest.approx(0.003004)
    assert b.m_hbm_bytes == 2_000_000  # p0's transient copy of all 2000 tokens
    # p0 runs no decodes and d0's do not wait for p0, but joining d0's batch slows its 2:
    # B(d0) = 2 · 10 · (1e-4 + 1e-8·2000)
    assert b.i_decode == pytest.approx(0.0024)
    assert b.total == pytest.approx(0.310604)


def test_remote_prefill_across_nodes_to_a_non_owner() -> None:
    req, _ = example()
    b = evaluate(M, req, _routes()[("remote_prefill", "p0", "d1")])
    assert b.t_network == pytest.approx(0.0032)  # 0.002 + 1e-3 + 2e6 / 1e10
    assert b.t_nic == pytest.approx(0.0012)  # what p0's node NIC is busy with: the link part
    assert b.m_hbm_bytes == 3_600_000  # 2e6 transient on p0 + 1.6e6 owned prefix now on d1
    assert b.i_decode == pytest.approx(0.0012)  # B(d1) = 1 · 10 · (1e-4 + 1e-8·2000)
    assert b.total == pytest.approx(0.3402)
    # with 0.5 s already queued on p0's node NIC, the KV leaves after it; the NIC time is the same
    r = _routes()[("remote_prefill", "p0", "d1")]
    busy = evaluate(M, req, replace(r, prefill=replace(r.prefill, nic_backlog_s=0.5)))
    assert busy.t_network == pytest.approx(0.5032) and busy.t_nic == pytest.approx(0.0012)
    assert busy.total == pytest.approx(0.8402)
    # on one node nothing crosses a NIC
    same = evaluate(M, req, _routes()[("remote_prefill", "p0", "d0")])
    assert same.t_nic == 0.0


def test_state_migration_counts_the_copy_left_behind_and_pays_the_hysteresis() -> None:
    req, _ = example()
    b = evaluate(M, req, _routes()[("state_migration", "d1", "d1")])
    assert b.t_prefill == pytest.approx(0.0572)  # d1 reuses the 1600 moved tokens
    assert b.t_network == pytest.approx(0.00116)  # 1e-3 + 1.6e6 / 1e10
    assert b.m_hbm_bytes == 1_600_000  # d0 keeps its copy: the moved blocks are a duplicate
    # d1's one running decode waits 0.0572, + B(d1) = 1 · 10 · (1e-4 + 1e-8·2000) = 0.0012
    assert b.i_decode == pytest.approx(0.0584)
    # C0 = 0.1594 + 0.00116 + λ·1.6e6 + 0.0584 = 0.22056; H = 0.05 + 0.1 · 0.22056
    assert b.h_move == pytest.approx(0.072056)
    assert b.total == pytest.approx(0.292616)
    # no hysteresis for any other action
    assert evaluate(M, req, _routes()[("remote_prefill", "p0", "d1")]).h_move == 0.0


def test_moving_back_to_a_worker_holding_an_old_copy_duplicates_only_the_delta() -> None:
    # d1 held the session before (12 of its 16 blocks): moving back copies 4 blocks
    req, cl = example()
    d0, d1 = cl.workers[1], worker("d1", Role.DECODE, "node1", gpu=12, running=1, kv_usage=0.5)
    r = Route(Action.STATE_MIGRATION, d1, d1, d0)
    b = evaluate(M, req, r)
    assert b.t_network == pytest.approx(1e-3 + 4e5 / 1e10)
    assert b.m_hbm_bytes == 400_000
    fresh = evaluate(M, req, _routes()[("state_migration", "d1", "d1")])
    assert b.total < fresh.total


def test_interference_is_each_running_decode_waiting_for_the_whole_prefill() -> None:
    # not capped by max_num_seqs (100 in the unit profile): 300 decodes each wait the prefill
    # (1000 tokens: 0.115), and each steps with the request in its batch for its 10 decode
    # steps, B = running · 10 · (1e-4 + 1e-8·1000) = running · 0.0011
    req = request(1000)
    for running in (0, 1, 7, 300):
        w = worker("h", Role.HYBRID, running=running)
        r = Route(Action.COLOCATED_PREFILL, w, w)
        assert evaluate(M, req, r).i_decode == pytest.approx(running * (0.115 + 0.0011))
    p = worker("p", Role.PREFILL)
    d = worker("d", Role.DECODE, running=40)
    # D's 40 decodes wait for no prefill, only the request joining their batch: 40 · 0.0011
    assert evaluate(M, req, Route(Action.REMOTE_PREFILL, p, d)).i_decode == pytest.approx(0.044)
    # a busy prefill worker's running requests are prefills: nothing to stall
    busy_p = worker("p", Role.PREFILL, running=9)
    assert evaluate(M, req, Route(Action.REMOTE_PREFILL, busy_p, d)).i_decode == pytest.approx(
        0.044
    )
    # a hybrid P stalls its own decodes
    h = worker("h", Role.HYBRID, running=3)
    assert evaluate(M, req, Route(Action.REMOTE_PREFILL, h, d)).i_decode == pytest.approx(
        3 * 0.115 + 0.044
    )


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
    b = evaluate(M, req, r)
    assert b.t_restore == pytest.approx(0.0033)
    assert b.t_prefill == pytest.approx(0.01 + 0.02 + 1e-8 * 200 * 900)  # 800 reused
    # the whole prompt cached: the last token is still computed
    w9 = worker("d0", Role.DECODE, gpu=10)
    assert evaluate(M, req, Route(Action.COLOCATED_PREFILL, w9, w9)).t_prefill == pytest.approx(
        0.01 + 1e-4 + 1e-8 * 1 * 999.5
    )


def test_cold_restore_uses_the_restore_planner_when_a_kv_spec_is_configured() -> None:
    spec = load_spec("llama3-8b")
    model = CostModel(replace(UNIT_CONFIG, kv_spec="llama3-8b"), {"unit": UNIT})
    req = request(1050)
    w = worker("d0", Role.DECODE, cpu=10)
    expected = plan_restore(spec, 1000, Tier.CPU, UNIT).restore_s
    assert expected > 0
    b = evaluate(model, req, Route(Action.TAIL_RECOMPUTE, w, w))
    assert b.t_restore == pytest.approx(expected)
    # with part of the prefix in GPU, the plain tier load applies
    w2 = worker("d0", Role.DECODE, gpu=4, cpu=10)
    b2 = evaluate(model, req, Route(Action.TAIL_RECOMPUTE, w2, w2))
    assert b2.t_restore == pytest.approx(6e5 / 1e9)


def test_decode_horizon_caps_the_counted_decode_steps() -> None:
    req, _ = example()
    r = _routes()[("colocated_prefill", "d0", "d0")]
    for max_tokens, steps in ((2, 2), (10_000, 10)):
        b = evaluate(M, replace(req, max_tokens=max_tokens), r)
        assert b.t_compute - b.t_prefill == pytest.approx(steps * 0.00632)
        assert b.t_decode_step == pytest.approx(0.00632)


def test_config_from_settings_and_bad_configs() -> None:
    cfg = CostConfig.from_settings(
        PlannerSettings(
            lambda_hbm=2e-11, mu_interference=0.5, migration_margin_s=0.2, migration_margin_rel=0.3
        )
    )
    assert (cfg.lam, cfg.mu, cfg.profile, cfg.kv_spec) == (2e-11, 0.5, "h100-llama3-8b", None)
    assert (cfg.migration_margin_s, cfg.migration_margin_rel) == (0.2, 0.3)
    assert CostConfig.from_settings(PlannerSettings(xi_duplicate=0.0)).xi == 0.0
    assert CostConfig.from_settings(PlannerSettings()) == CostConfig()  # one set of defaults
    cfg = CostConfig.from_settings(PlannerSettings(), kv_spec="llama3-8b")
    assert CostModel(cfg).spec is not None
    for kw in ({"lam": -1.0}, {"migration_margin_s": -0.1}, {"migration_margin_rel": -1.0}):
        with pytest.raises(ConfigError):
            CostConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CostModel(CostConfig(profile="missing"), {"unit": UNIT})
    with pytest.raises(ConfigError):
        CostModel(CostConfig(profile="no-such-profile-file"))
    slow_intra = replace(UNIT, link=replace(UNIT.link, intra_node_bps=1e9))
    with pytest.raises(ConfigError, match="same_host KV transport is slower"):
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


def test_kv_wait_is_zero_with_room_scaled_by_the_shortage_and_prohibitive_past_the_pool() -> None:
    k = RequestCosts(M, request(1000))  # need = N + O = 1010 tokens
    w = worker("d", Role.DECODE, kv_capacity_tokens=10_000, running=4)
    assert k.kv_wait(replace(w, kv_usage=0.5), 0, 0.2, 0.0) == 0.0
    # used 9,500 + 100 in flight: 1010 − 400 = 610 short, 610 / 9,600 of a 0.2 s decode
    busy = replace(w, kv_usage=0.95, inflight_prefill_tokens=100)
    assert k.kv_wait(busy, 0, 0.2, 0.0) == pytest.approx(610 / 9600 * 0.2)
    # 5 blocks already in GPU need 500 tokens less: then it fits
    assert k.kv_wait(busy, 5, 0.2, 0.0) == pytest.approx(110 / 9600 * 0.2)
    assert k.kv_wait(replace(w, kv_capacity_tokens=1000), 0, 0.2, 0.0) == KV_NEVER_S
    # without a capacity from the worker, the profile's HBM (1e6 tokens here) is the pool
    assert k.worker(replace(w, kv_capacity_tokens=0, kv_usage=0.5)).queue_s == 0.0
    full_w = replace(w, kv_capacity_tokens=0, kv_usage=0.9995)
    full = k.worker(full_w)
    # of the request's own decode: the decode column less μ·B (μ = 1)
    own = full.decode_s - k.batch_s(full_w)
    assert own < full.decode_s
    assert full.queue_s == pytest.approx((1010 - 500) / 999_500 * own)


def test_displacement_prices_the_working_set_pushed_out() -> None:
    k = RequestCosts(M, request(1000))  # need = N + O = 1010 tokens
    w = worker("d", Role.DECODE, kv_capacity_tokens=10_000, ws_tokens=9_500)
    # 1010 − (10,000 − 9,500) = 510 tokens displaced, recomputed: (1e-4 + 1e-8·510/2)·510
    wd = 510 * (1e-4 + 1e-8 * 255)
    terms = k.worker(w)
    assert terms.w_disp_s == pytest.approx(wd)
    assert terms.queue_s == pytest.approx(wd)  # q carries W_disp (no queue, no kv_wait here)
    b = k.breakdown(Route(Action.COLOCATED_PREFILL, w, w))
    assert b.w_disp == pytest.approx(wd) and b.t_queue == pytest.approx(0.0)
    assert b.total == pytest.approx(b.t_compute + wd + b.lam * b.m_hbm_bytes)
    # 5 blocks already in its GPU need 500 tokens less
    assert k.displacement(w, 5, 9_500, 10_000, k.constants("unit")) == pytest.approx(
        10 * (1e-4 + 1e-8 * 5)
    )
    # a worker offloading to CPU reloads the displaced KV: 510 · 1000 B / 1e9 B/s
    assert k.worker(replace(w, offloads=True)).w_disp_s == pytest.approx(5.1e-4)
    # the request's own session counted there is its own KV, not displaced
    own = RequestCosts(M, request(1000, home_worker="d", home_tokens=2_000))
    assert own.worker(w).w_disp_s == 0.0
    assert own.worker(replace(w, worker_id="other")).w_disp_s == pytest.approx(wd)
    # room for it, or ν = 0: nothing displaced
    assert k.worker(replace(w, ws_tokens=8_000)).w_disp_s == 0.0
    off = RequestCosts(unit_model(replace(UNIT_CONFIG, nu=0.0)), request(1000))
    assert off.worker(w).w_disp_s == 0.0
    with pytest.raises(ConfigError):
        CostConfig(nu=-1.0)


def test_displacement_keeps_a_session_home_when_moving_would_push_others_out() -> None:
    # the session's home h0 holds 900 of its 1000 tokens but has 15 prefills waiting (0.15 s);
    # h1 is idle but its pool is full of other sessions' working sets
    req = request(1000, session_id="s", session_owner="h0", home_worker="h0", home_tokens=900)
    h0 = worker("h0", Role.HYBRID, gpu=9, waiting=15, kv_capacity_tokens=10_000, ws_tokens=900)
    h1 = worker("h1", Role.HYBRID, kv_capacity_tokens=10_000, ws_tokens=10_000)
    blind = OwnerServePolicy(model=unit_model(replace(UNIT_CONFIG, nu=0.0)))
    assert blind.plan(req, cluster(h0, h1)).chosen.decode_worker == "h1"
    plan = OwnerServePolicy(model=M).plan(req, cluster(h0, h1))
    assert plan.chosen.decode_worker == "h0"
    assert plan.runner_up is not None and plan.runner_up.cost.w_disp > 0.1


def test_moving_a_resident_session_pays_the_hysteresis_of_a_migration() -> None:
    # both workers hold the prefix; h1 is a little faster (h0 has one prefill waiting)
    req = request(1000, session_id="s", home_worker="h0", home_tokens=1000)
    h0 = worker("h0", Role.HYBRID, gpu=9, waiting=1)
    h1 = worker("h1", Role.HYBRID, gpu=9)
    k = RequestCosts(M, req)
    stay = k.breakdown(Route(Action.COLOCATED_PREFILL, h0, h0))
    move = k.breakdown(Route(Action.COLOCATED_PREFILL, h1, h1))
    assert stay.h_move == 0.0
    # 0.05 s + 0.1 of the move's other terms
    assert move.h_move == pytest.approx(0.05 + 0.1 * (move.total - move.h_move))
    plan = OwnerServePolicy(model=M).plan(req, cluster(h0, h1))
    assert plan.chosen.decode_worker == "h0"
    # without a home (a session not counted anywhere) the faster worker wins
    free = OwnerServePolicy(model=M).plan(request(1000, session_id="s"), cluster(h0, h1))
    assert free.chosen.decode_worker == "h1"


def test_displacement_counts_the_sessions_expected_growth() -> None:
    w = worker("d", Role.DECODE, kv_capacity_tokens=10_000, ws_tokens=8_000)
    # 1010 tokens fit beside 8,000 others; with 3,000 more to come they do not
    assert RequestCosts(M, request(1000)).worker(w).w_disp_s == 0.0
    grown = RequestCosts(M, request(1000, growth_tokens=3_000))
    disp = 1010 + 3000 - 2000
    assert grown.worker(w).w_disp_s == pytest.approx(disp * (1e-4 + 1e-8 * disp / 2))


def test_a_worker_closed_to_programs_takes_no_session_not_resident_there() -> None:
    # h0 holds the whole prefix but admission closed it to programs; h1 is open and empty
    h0 = worker("h0", Role.HYBRID, gpu=9, programs_closed=True)
    h1 = worker("h1", Role.HYBRID)
    new = request(1000, session_id="s")
    plan = OwnerServePolicy(model=M).plan(new, cluster(h0, h1))
    assert plan.chosen.decode_worker == "h1" and plan.chosen.prefill_worker == "h1"
    assert RequestCosts(M, new).worker(h0).queue_s >= PROGRAMS_CLOSED_S
    # a session resident there is not charged: admission pauses it, or it runs on, at home
    home = request(1000, session_id="s", home_worker="h0", home_tokens=1000)
    assert OwnerServePolicy(model=M).plan(home, cluster(h0, h1)).chosen.decode_worker == "h0"
    # every worker closed: the other terms decide, as if none were
    both = cluster(h0, replace(h1, programs_closed=True))
    assert OwnerServePolicy(model=M).plan(new, both).chosen.decode_worker == "h0"


def test_one_scan_of_many_workers_gives_each_the_terms_it_has_alone() -> None:
    # two profiles taking turns (their constants change mid-scan), holders in GPU and CPU, and
    # a worker whose pool displaces working-set KV: the columns' rows are each worker's terms
    fast = replace(UNIT, name="fast", prefill=replace(UNIT.prefill, per_token_s=5e-5))
    model = CostModel(UNIT_CONFIG, {"unit": UNIT, "fast": fast})
    ws = (
        worker("a", Role.HYBRID, gpu=3, cpu=6, running=2),
        replace(worker("b", Role.DECODE, running=5, kv_usage=0.2), profile="fast"),
        worker("c", Role.DECODE, kv_capacity_tokens=10_000, ws_tokens=9_500),
        replace(worker("d", Role.PREFILL, gpu=4, waiting=2), profile="fast"),
        worker("e", Role.DECODE),
    )
    k = RequestCosts(model, request(1000))
    terms = k.scan(ws)
    assert [terms.row(i) for i in range(len(ws))] == [k.worker(w) for w in ws]
    assert terms.holds == [True, False, False, True, False]
    # a: 6 blocks held (3 in GPU), so r = 600 and 3 blocks come from CPU: 3e5 B / 1e9 B/s
    assert terms.held_terms(0) == (3, 6, 600, pytest.approx(3e-4), 0, 6)
    assert terms.held_terms(1) is None and terms.row(1).held is None
    assert terms.w_disp_s[2] > 0.0 and terms.w_disp_s[0] == terms.w_disp_s[4] == 0.0
    # the fast profile's prefill: 0.01 + 5e-5·1000 + 1e-8·1000·500 on nothing
    assert terms.prefill_s[1] == pytest.approx(0.065)
