"""The simulator with a HeteroCache spec: blocks sized by the spec, CPU-tier restores planned
by planner.restore under the SWA policy, the window checkpoints each policy writes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import SimSession, SimTurn
from ownerserve.kvstate import SwaPolicy, load_spec
from ownerserve.profiles import load_profile
from ownerserve.types import Tier
from planner.restore import plan_restore
from planner.types import (
    Action,
    Candidate,
    ClusterView,
    CostBreakdown,
    Plan,
    RequestClass,
    RequestView,
)

PROFILE = load_profile("h100-llama3-8b")
V4 = load_spec("deepseek-v4")
BT = 128
BB = round(V4.bytes_per_token() * BT)  # 636096 B: a 128-token block of sealed V4 KV


class _Colocated:
    name = "fixed"

    def __init__(self) -> None:
        self.seen: list[RequestView] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.seen.append(request)
        cand = Candidate(Action.COLOCATED_PREFILL, "h0", "h0", CostBreakdown())
        return Plan(self.name, RequestClass.NEW_LONG_PREFIX, cand)


def _sessions() -> list[SimSession]:
    # A's two blocks are evicted to the CPU tier by B, then A comes back for them
    return [
        SimSession(0, 0.0, (SimTurn((1, 2), 256, 1, 0.0), SimTurn((1, 2, 3), 384, 1, 50.0))),
        SimSession(1, 1.0, (SimTurn((5, 6, 7), 384, 1, 0.0),)),
    ]


def _run(policy: SwaPolicy | None, typed: bool = True) -> tuple[Simulator, _Colocated]:
    spec = ClusterSpec(0, 0, 1, block_tokens=BT, hbm_kv_bytes=3 * BB, cpu_blocks=100)
    kv = V4 if policy is None else replace(V4, swa_policy=policy)
    pol = _Colocated()
    sim = Simulator(spec, PROFILE, pol, kv_spec=kv, typed_state=typed)
    sim.res = sim.run(_sessions())  # type: ignore[attr-defined]
    return sim, pol


def test_blocks_are_sized_by_the_spec_and_the_planner_sees_it() -> None:
    sim, pol = _run(SwaPolicy.full())
    assert sim.block_bytes == BB and sim.workers[0].capacity == 3
    assert all(r.kv_spec is not None and r.kv_spec.name == "deepseek-v4" for r in pol.seen)
    lru, _ = _run(None, typed=False)  # every token's window entries kept with its block
    assert lru.block_bytes == round((4969.5 + 61 * 576) * BT)


def test_a_cpu_restore_is_the_restore_plan_under_the_swa_policy() -> None:
    full, _ = _run(SwaPolicy.full())
    zero, _ = _run(SwaPolicy.zero())
    rf, rz = full.res, zero.res  # type: ignore[attr-defined]
    assert len(rf.restore_load_s) == len(rz.restore_load_s) == 1  # A's return
    want = plan_restore(
        replace(V4, swa_policy=SwaPolicy.full()), 256, Tier.CPU, PROFILE, overlap=False
    )
    assert rf.restore_load_s[0] == pytest.approx(want.load_s) and want.loaded_bytes > 0
    assert rf.restore_recompute_s[0] == pytest.approx(want.restore_s - want.load_s)
    # zero caching: the windows need the last 7808 tokens, i.e. all 256: nothing loads
    assert rz.restore_load_s[0] == 0.0
    assert rz.restore_recompute_s[0] == pytest.approx(PROFILE.prefill_s(256, 0))
    assert rz.restore_recompute_s[0] > rf.restore_recompute_s[0] + rf.restore_load_s[0]


def test_the_window_checkpoints_written_per_policy() -> None:
    per_token = 61 * 576
    full, _ = _run(SwaPolicy.full())
    assert full.res.swa_written_bytes == (384 + 384) * per_token  # type: ignore[attr-defined]
    zero, _ = _run(SwaPolicy.zero())
    assert zero.res.swa_written_bytes == 0  # type: ignore[attr-defined]
    p256, _ = _run(SwaPolicy.periodic(256))
    # one checkpoint of a full 128-entry window at 256 per session
    assert p256.res.swa_written_bytes == 2 * 61 * 128 * 576  # type: ignore[attr-defined]
    assert full.res.offload_bytes == zero.res.offload_bytes > 0  # type: ignore[attr-defined]


def test_sglang_peers_keep_no_window_checkpoints_and_the_others_the_spec_s_policy() -> None:
    from loadgen.sim.cli import peer_kv_spec

    assert peer_kv_spec("sglang-cache-aware", V4).swa_policy == SwaPolicy.zero()  # type: ignore[union-attr]
    assert peer_kv_spec("dynamo-kv", V4) is V4
    assert peer_kv_spec("ownerserve", V4) is V4
    assert peer_kv_spec("sglang-cache-aware", None) is None
