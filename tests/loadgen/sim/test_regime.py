"""The simulator under KV pressure: working sets in the views, the CPU tier behind HBM,
program-level gates (the router's admission, ThunderAgent) and goodput at a TTFT SLO."""

from __future__ import annotations

from pathlib import Path

from loadgen.sim.admission import RouterAdmission, ThunderAgentGate
from loadgen.sim.cli import main_rows, split_roles
from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.plots import plot_rates
from loadgen.sim.workload import SimSession, SimTurn, kv_working_set
from ownerserve.profiles import load_profile
from ownerserve.types import Tier
from planner.policies import get_policy
from planner.policies.peers.thunderagent import ProgramScheduler, ThunderAgentConfig
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
BT = 512
BLOCK_BYTES = BT * PROFILE.kv_bytes_per_token


class _Recording:
    """Always (colocated, `wid`); keeps every request and view it was asked about."""

    def __init__(self, wid: str) -> None:
        self.name = "recording"
        self.wid = wid
        self.seen: list[tuple[RequestView, ClusterView]] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.seen.append((request, cluster))
        cand = Candidate(Action.COLOCATED_PREFILL, self.wid, self.wid, CostBreakdown())
        return Plan(self.name, RequestClass.NEW_LONG_PREFIX, cand)


def _turn(chain: tuple[int, ...], out: int = 10, gap: float = 0.0) -> SimTurn:
    return SimTurn(chain, len(chain) * BT, out, gap)


def _blocks(session: int, n: int) -> tuple[int, ...]:
    """The first `n` blocks of a chain of `session`'s own."""
    return tuple(100 * session + k for k in range(1, n + 1))


def _hybrid(n: int = 1, hbm_blocks: int = 100, cpu_blocks: int = 0) -> ClusterSpec:
    return ClusterSpec(0, 0, n, hbm_kv_bytes=hbm_blocks * BLOCK_BYTES, cpu_blocks=cpu_blocks)


def test_a_sessions_working_set_is_in_the_views_and_its_home_in_the_request() -> None:
    policy = _Recording("h0")
    sim = Simulator(_hybrid(), PROFILE, policy)
    sessions = [SimSession(0, 0.0, (_turn((1, 2), out=100), _turn((1, 2, 3), gap=1.0)))]
    sim.run(sessions)
    (first, _), (second, view) = policy.seen
    assert first.home_worker is None and first.home_tokens == 0
    # kept through its short gap: its prompt and output, counted on h0
    assert (second.home_worker, second.home_tokens) == ("h0", 2 * BT + 100)
    assert view.workers[0].ws_tokens == 2 * BT + 100


def test_evicted_blocks_move_to_the_cpu_tier_and_load_from_there() -> None:
    a, b = (1, 2, 3, 4), (11, 12, 13, 14)
    sessions = [
        SimSession(0, 0.0, (_turn(a), _turn((*a, 5), gap=10.0))),
        SimSession(1, 1.0, (_turn(b),)),
    ]
    plain = Simulator(_hybrid(hbm_blocks=6), PROFILE, _Recording("h0")).run(sessions)
    policy = _Recording("h0")
    tiered = Simulator(_hybrid(hbm_blocks=6, cpu_blocks=16), PROFILE, policy).run(sessions)
    # without the tier session 0's second turn recomputes its evicted prefix; with it, loads it
    assert tiered.cpu_hit_tokens > 0
    assert tiered.prefill_tokens == plain.prefill_tokens - tiered.cpu_hit_tokens
    request, view = policy.seen[-1]
    assert request.chain == (*a, 5)
    blocks = view.workers[0].cached_blocks
    assert blocks[Tier.CPU] > blocks.get(Tier.GPU, 0)
    assert view.workers[0].offloads


def test_goodput_counts_completed_sessions_whose_p90_ttft_met_the_slo() -> None:
    sessions = [SimSession(i, float(i), (_turn((i + 1,)),)) for i in range(4)]
    loose = Simulator(_hybrid(), PROFILE, _Recording("h0"), slo_ttft_p90_s=10.0)
    res = loose.run(sessions)
    assert res.sessions_good == res.sessions_completed == 4
    assert res.rate_per_min == 60.0 * 4 / 3  # offered: sessions over their arrival span
    assert res.goodput_per_min == res.rate_per_min
    strict = Simulator(_hybrid(), PROFILE, _Recording("h0"), slo_ttft_p90_s=1e-6)
    assert strict.run(sessions).goodput_per_min == 0.0


def test_the_router_admission_holds_requests_until_the_worker_drains() -> None:
    spec = _hybrid(hbm_blocks=4)
    sim = Simulator(spec, PROFILE, _Recording("h0"))
    cap = 4 * BT
    sim.gate = RouterAdmission(["h0"], lambda wid: sim.by_id[wid].decode_ctx / cap)
    sessions = [SimSession(i, 0.001 * i, (_turn(_blocks(i, 4)),)) for i in range(3)]
    res = sim.run(sessions)
    # the first fills the worker past the high watermark: the others wait for it, one by one
    assert res.queued == 2 and len(res.queue_waits_s) == 2
    assert min(res.queue_waits_s) > 0
    assert res.sessions_completed == 3 and res.rejected_429 == 0


def test_thunderagent_pauses_and_resumes_programs_in_the_simulator() -> None:
    spec = _hybrid(n=1, hbm_blocks=8)
    policy = get_policy("thunderagent")
    sim = Simulator(spec, PROFILE, policy, full_view=True)
    cfg = ThunderAgentConfig(buffer_tokens=0, interval_s=0.5)
    sim.gate = ThunderAgentGate(ProgramScheduler({"h0": 8 * BT}, cfg))
    res = sim.run(
        [
            SimSession(i, 0.0, (_turn(_blocks(i, 4), out=50), _turn(_blocks(i, 5), gap=2.0)))
            for i in range(2)
        ]
    )
    assert res.paused > 0 and res.queued > 0
    assert res.sessions_completed == 2


def test_the_working_set_sizing_counts_shared_blocks_once() -> None:
    shared = SimSession(0, 0.0, (_turn((1, 2, 3), out=0),))
    other = SimSession(1, 0.0, (_turn((1, 2, 4), out=0),))
    peak, largest = kv_working_set([shared, other], PROFILE, BT)
    assert (peak, largest) == (4, 3)


def test_agentic_long_sweeps_rates_with_time_scale_cpu_tier_and_thunderagent() -> None:
    rows = main_rows(
        [
            *("--workers", "6", "--workload", "agentic-long", "--scale", "0.02"),
            *("--time-scale", "0.01", "--sessions", "7", "--rates", "30,120"),
            *("--block-tokens", "64", "--hbm-pressure", "3", "--cpu-blocks", "-1"),
            *("--policies", "ownerserve,thunderagent"),
        ]
    )
    assert [(r["policy"], r["rate_per_min"]) for r in rows] == [
        ("ownerserve", 30.0),
        ("thunderagent", 30.0),
        ("ownerserve", 120.0),
        ("thunderagent", 120.0),
    ]
    for r in rows:
        assert r["sessions_completed"] == r["sessions"] > 7  # subagents on top
        assert 0 < r["goodput_per_min"] <= r["rate_per_min"]


def test_the_own_policies_cluster_split_is_chosen_by_shares() -> None:
    assert split_roles("1:1:1", 64) == {"prefill": 21, "decode": 21, "hybrid": 22}
    assert split_roles("0:0:1", 64) == {"prefill": 0, "decode": 0, "hybrid": 64}
    assert split_roles("1:1:0", 65) == {"prefill": 32, "decode": 33, "hybrid": 0}


def test_a_sweep_is_plotted_against_the_rate(tmp_path: Path) -> None:
    rows = [
        {"policy": p, "rate_per_min": r, "goodput_per_min": r, "e2e_mean_s": 1.0}
        for p in ("a", "b")
        for r in (60.0, 120.0)
    ]
    assert plot_rates(rows[:1], tmp_path) == []  # one rate: no curve
    (path,) = plot_rates(rows, tmp_path)
    assert path.name == "sim_rates.png" and path.stat().st_size > 0
