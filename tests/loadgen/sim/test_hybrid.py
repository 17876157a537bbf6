"""The simulator with a HeteroCache spec: blocks sized by the spec, CPU-tier restores planned
by planner.restore under the SWA policy, the window checkpoints each policy writes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import SimSession, SimTurn
from ownerserve.kvstate import SwaPolicy, load_spec
from ownerserve.kvstate.retention import Retention
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


class _Watching(_Colocated):
    def __init__(self) -> None:
        super().__init__()
        self.restorable: list[int | None] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.restorable.append(cluster.workers[0].restorable_blocks)
        return super().plan(request, cluster)


def _resume_run(retention: Retention | None) -> tuple[Simulator, _Watching]:
    """A computes a 100-block prompt on h0; B then shares its first 90 blocks."""
    a = tuple(range(1, 101))
    b = (*a[:90], 301, 302)
    sessions = [
        SimSession(0, 0.0, (SimTurn(a, 100 * BT + 5, 1, 0.0),)),
        SimSession(1, 60.0, (SimTurn(b, 92 * BT + 5, 1, 0.0),)),
    ]
    spec = ClusterSpec(0, 0, 1, block_tokens=BT, hbm_kv_bytes=1000 * BB)
    pol = _Watching()
    sim = Simulator(spec, PROFILE, pol, kv_spec=V4, retention=retention)
    sim.res = sim.run(sessions)  # type: ignore[attr-defined]
    return sim, pol


def test_a_gpu_hit_resumes_where_the_retention_kept_its_windows() -> None:
    """The engine's resume rule in the simulator: B's 90-block hit on A's prefix resumes at
    the deepest boundary whose windows h0 kept (the planner sees it too), cut back or
    rebuilt by the rule's times (hand-computed in tests/ownerserve/kvstate/test_resume.py)."""
    # every boundary keeps its windows (the default): cached at 90, nothing shown
    full, pol = _resume_run(None)
    assert pol.restorable == [None, None]
    assert full.res.resumes == {"cached": 1}  # type: ignore[attr-defined]
    assert full.res.reused_tokens == 90 * BT  # type: ignore[attr-defined]
    # every 40 blocks and the last: windows at 80; computing [80, 90) beats a 7808-token
    # rebuild, so B reuses 80 blocks
    p40, pol = _resume_run(Retention(40 * BT))
    assert pol.restorable == [None, 80]
    assert p40.res.resumes == {"truncated": 1}  # type: ignore[attr-defined]
    assert p40.res.reused_tokens == 80 * BT  # type: ignore[attr-defined]
    # only A's last boundary (100): none at or below 90; rebuilding 7808 tokens over 3712
    # beats computing all 11520, so B reuses 90 blocks and recomputes 7808 tokens more
    zero, pol = _resume_run(Retention(0))
    assert pol.restorable == [None, 0]
    assert zero.res.resumes == {"rebuilt": 1}  # type: ignore[attr-defined]
    assert zero.res.window_rebuild_tokens == 7808  # type: ignore[attr-defined]
    assert zero.res.reused_tokens == 90 * BT  # type: ignore[attr-defined]
    assert zero.res.ttft_s[1] > full.res.ttft_s[1]  # type: ignore[attr-defined]


class _FetchSecond:
    """A's turn on h0, then B fetched from h0 to h1."""

    name = "fixed"

    def __init__(self) -> None:
        self.calls = 0

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.calls += 1
        if self.calls == 1:
            cand = Candidate(Action.COLOCATED_PREFILL, "h0", "h0", CostBreakdown())
        else:
            cand = Candidate(Action.ARTIFACT_FETCH, "h1", "h1", CostBreakdown(), "h0")
        return Plan(self.name, RequestClass.FORKED_ROLLOUT, cand)


def test_a_fetch_moves_sealed_kv_only_and_the_destination_rebuilds_the_windows() -> None:
    a = tuple(range(1, 101))
    sessions = [
        SimSession(0, 0.0, (SimTurn(a, 100 * BT + 5, 1, 0.0),)),
        SimSession(1, 60.0, (SimTurn((*a, 301), 101 * BT + 5, 1, 0.0),)),
    ]
    spec = ClusterSpec(0, 0, 2, block_tokens=BT, hbm_kv_bytes=1000 * BB)
    sim = Simulator(spec, PROFILE, _FetchSecond(), kv_spec=V4)
    res = sim.run(sessions)
    assert [w.wid for w in sim.workers] == ["h0", "h1"]
    assert res.fetch_kv_bytes == 100 * BB == V4.sealed_bytes(0, 100 * BT)  # no windows
    assert res.resumes == {"rebuilt": 1}  # h1 held nothing: all 7808 rebuilt over 4992
    assert res.window_rebuild_tokens == 7808 and res.reused_tokens == 100 * BT
