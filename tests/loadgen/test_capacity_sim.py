"""The simulator's capacity driver on a small real simulation: each request's samples come back
for its session (as many as the engine ran, TTFT as the engine measured it), the references
are the unloaded formulas, every rate replays the same sessions, shapes per target, and the
emulated bench's observation from client records."""

from __future__ import annotations

import pytest

from loadgen.capacity import CapacityPoint, KVDemand, observation
from loadgen.capacity_report import capacity_table, rows
from loadgen.capacity_search import (
    LOOSE,
    TIGHT,
    SearchSettings,
    attainment,
    search_target,
    unloaded_ttft_s,
)
from loadgen.capacity_sim import (
    OWN_SPLITS,
    PD_SPLITS,
    SimCase,
    sim_case,
    sim_observation,
    splits_for,
)
from loadgen.client import RequestRecord, RunResult, SessionRecord
from loadgen.report import ClusterStats, summarize
from ownerserve.kvstate import KVStateSpec
from ownerserve.profiles import load_profile

PROFILE = load_profile("h100-llama3-8b")


@pytest.fixture(scope="module")
def case():
    return sim_case(
        "agentic-long",
        4,
        PROFILE,
        sessions=4,
        scale=0.02,
        time_scale=0.005,
        seed=1,
        sizing_rate=240.0,
    )


def test_every_request_comes_back_for_its_session(case) -> None:
    obs = sim_observation(case, "ownerserve", "1:1:2", 120.0, PROFILE)
    d = obs.detail
    assert len(obs.sessions) == len(case.sessions) == d["sessions"]
    assert sum(len(s.requests) for s in obs.sessions) == d["requests"]
    ratios = []
    for si, s in enumerate(obs.sessions):
        assert len(s.requests) == len(case.sessions[si].turns)  # nothing refused here
        assert s.completed
        for ti, r in enumerate(s.requests):
            assert r.ttft_ref_s == case.ttft_ref_s[si][ti]
            assert r.ttft_s is not None and r.ttft_s > 0
            ratios.append(r.ttft_s / r.ttft_ref_s)
            if r.tpot_s is not None:  # a decode step at batch 1 is the least it can take
                assert r.tpot_s >= r.tpot_ref_s * 0.999
    # the reference's cache follows the planned order; a turn may find a prefix that came in
    # earlier than planned, but the typical request is not faster than alone
    assert sorted(ratios)[len(ratios) // 2] >= 0.95
    assert d["sessions_completed"] == sum(s.completed for s in obs.sessions)
    assert 0 < d["prefill_tokens_ideal"] <= d["prefill_tokens"]


def test_references_are_the_session_alone_and_the_ideal_is_a_shared_cache(case) -> None:
    bt = case.block_tokens
    for si, s in enumerate(case.sessions):
        first = s.turns[0]
        # alone, a session's first prompt is computed whole; later ones reuse its previous one
        assert case.ttft_ref_s[si][0] == unloaded_ttft_s(PROFILE, first.input_tokens, 0)
        prev, t = s.turns[0], s.turns[1]
        hit = next(i for i in range(len(t.chain) + 1) if i == len(prev.chain) or
                   i == len(t.chain) or t.chain[i] != prev.chain[i])  # fmt: skip
        cached = hit * bt
        assert cached > 0
        assert case.ttft_ref_s[si][1] == unloaded_ttft_s(PROFILE, t.input_tokens - cached, cached)
        # a cluster-wide cache computes no more than the session alone would
        assert case.ideal_prefill_tokens[si][1] <= t.input_tokens - cached
    # sessions of one repository share their first prompt's prefix: the ideal counts it once
    firsts = [case.ideal_prefill_tokens[si][0] for si in range(len(case.sessions))]
    assert sum(firsts) < sum(s.turns[0].input_tokens for s in case.sessions)


def test_every_rate_replays_the_same_sessions_closer_together(case) -> None:
    slow, fast = case.sessions_at(60.0), case.sessions_at(240.0)
    assert [s.turns for s in slow] == [s.turns for s in fast]
    pairs = zip(slow, fast, strict=True)
    mains = [(a.start_s, b.start_s) for a, b in pairs if a.start_s and a.spawned_at is None]
    assert mains and all(a == pytest.approx(4 * b) for a, b in mains)


def test_targets_are_searched_on_their_own_shapes() -> None:
    assert splits_for("ownerserve") == OWN_SPLITS
    assert splits_for("static-pd") == PD_SPLITS
    assert splits_for("sglang-router pd cache_aware") == PD_SPLITS
    assert splits_for("vllm-router cache_aware") == ("0:0:1",)
    assert splits_for("colocated") == ("0:0:1",)


def test_a_hybrid_spec_sizes_the_hbm_by_its_bytes_and_reaches_every_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a HeteroCache spec the same blocks of HBM hold the spec's bytes, and each target's
    simulator keeps its KV by it (an SGLang peer without window checkpoints)."""
    import loadgen.capacity_sim as cs
    from ownerserve.kvstate import SwaCaching, load_spec

    spec = load_spec("deepseek-v4")

    def case_of(kv_spec: KVStateSpec | None) -> SimCase:
        return sim_case(
            "agentic-long", 4, PROFILE, sessions=3, scale=0.02, time_scale=0.005, seed=1,
            sizing_rate=240.0, kv_spec=kv_spec,
        )  # fmt: skip

    dense, hybrid = case_of(None), case_of(spec)
    assert hybrid.cpu_blocks == dense.cpu_blocks  # the same blocks
    per_block = round(spec.bytes_per_token() * hybrid.block_tokens)
    assert hybrid.hbm_kv_bytes == hybrid.cpu_blocks * per_block < dense.hbm_kv_bytes
    built = []
    real = cs.Simulator

    def simulator(*a, **kw):  # the real simulator, each one kept to read what it was given
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(cs, "Simulator", simulator)
    own = sim_observation(hybrid, "ownerserve", "0:0:1", 120.0, PROFILE)
    sim_observation(hybrid, "sglang-router cache_aware", "0:0:1", 120.0, PROFILE)
    peer_spec = built[1].kv_spec
    assert built[0].kv_spec is spec and peer_spec is not None
    assert peer_spec.swa_policy.caching is SwaCaching.ZERO
    assert built[0].block_bytes == per_block
    assert own.detail["requests"] == sum(len(s.turns) for s in hybrid.sessions)


def test_a_search_over_the_simulator_reports_each_target(case) -> None:
    settings = SearchSettings(start_rate=120.0, max_rate=480.0, min_rate=60.0, rel_tol=0.5)

    def runner(label: str):
        return lambda split: lambda rate: sim_observation(case, label, split, rate, PROFILE)

    out = [
        search_target(t, ["0:0:1"], runner(t), (TIGHT, LOOSE), settings)
        for t in ("colocated", "vllm-router cache_aware")
    ]
    data = rows(out, (TIGHT, LOOSE), lambda o: {"kv_bytes_moved": 0})
    assert {r["target"] for r in data} == {"colocated", "vllm-router cache_aware"}
    for r in data:
        assert r["capacity_per_min"] == r["capacity_per_min_by_slo"]["tight"]
        assert set(r["attainment"]) == {"tight", "loose"}
    table = capacity_table(out, (TIGHT, LOOSE), ["vllm-router cache_aware"], lambda o: {})
    assert "| colocated |" in table and "× best peer" in table


def _record(sid: str, step: int, ttft: float, e2e: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        session_id=sid, step=step, kind="k", label="t", sent_s=0.0, e2e_s=e2e,
        ttft_s=ttft if ok else None, itl_s=(), prompt_tokens=1000 if ok else 0,
        completion_tokens=11 if ok else 0, cached_tokens=0, status=200 if ok else 500,
        error=None if ok else "boom",
    )  # fmt: skip


def _session(sid: str, steps: int, done: int) -> SessionRecord:
    return SessionRecord(sid, "k", "g", 0.0, 0.0, 1.0, steps, done, 0.0)


def test_an_emulated_run_becomes_an_observation_and_a_late_one_is_discarded() -> None:
    alone = {("a", 0): 1000, ("a", 1): 100, ("b", 0): 1000}
    demand = KVDemand(10, 10, 10, dict.fromkeys(alone, 1), alone)
    ref1 = unloaded_ttft_s(PROFILE, 100, 900)
    result = RunResult(
        label="t",
        requests=(
            _record("a", 0, 0.08, 0.08 + 10 * 0.007),
            _record("a", 1, ref1 * 1.1, ref1 * 1.1 + 10 * 0.007),
            _record("b", 0, 0.0, 0.0, ok=False),
        ),
        sessions=(_session("a", 2, 2), _session("b", 1, 0)),
        wall_s=1.0,
        workload="w",
        target="t",
        started_at="",
        time_limited=False,
    )
    calm = ClusterStats(engine_late_s=0.1, engine_active_s=10.0)
    summary = summarize(result, cluster=calm)
    point = CapacityPoint(
        **{f: None for f in CapacityPoint.__dataclass_fields__}  # type: ignore[arg-type]
    )
    obs = observation(point, result, summary, demand, PROFILE, speed=1.0)
    assert obs.discarded is None
    a, b = obs.sessions
    assert a.completed and len(a.requests) == 2 and a.requests[1].ttft_ref_s == ref1
    assert a.requests[1].meets(TIGHT) and not b.completed and b.requests[0].ttft_s is None
    assert attainment(obs, TIGHT) == 0.5
    late = summarize(result, cluster=ClusterStats(engine_late_s=2.0, engine_active_s=10.0))
    assert observation(point, result, late, demand, PROFILE, 1.0).discarded is not None
