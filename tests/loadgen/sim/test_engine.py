"""The simulator's mechanics: prefix lookup, caches, transfers and per-policy accounting."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Generic, TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.sim.engine import ClusterSpec, Simulator
from loadgen.sim.workload import SimSession, SimTurn, agentic_sessions
from ownerserve.profiles import TransportTiming, load_profile
from ownerserve.types import KVTransport
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
T = TypeVar("T")


class _Fixed:
    """A policy that always plans the same (action, P, D); lets tests pin the execution."""

    def __init__(self, action: Action, p: str, d: str, source: str | None = None) -> None:
        self.name = f"fixed-{action.value}"
        self._cand = Candidate(action, p, d, CostBreakdown(), source_worker=source)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        return Plan(self.name, RequestClass.NEW_LONG_PREFIX, self._cand)


class _Spy(_Fixed, Generic[T]):
    """A `_Fixed` that keeps what `look` sees in every cluster view it plans on (`seen`)."""

    def __init__(self, action: Action, p: str, d: str, look: Callable[[ClusterView], T]) -> None:
        super().__init__(action, p, d)
        self._look = look
        self.seen: list[T] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.seen.append(self._look(cluster))
        return super().plan(request, cluster)


def _h0_kv_usage(cluster: ClusterView) -> float:
    return next(w.kv_usage for w in cluster.workers if w.worker_id == "h0")


def _nic_backlogs(cluster: ClusterView) -> dict[str, float]:
    return {w.worker_id: w.nic_backlog_s for w in cluster.workers}


def _session(chains: list[tuple[int, ...]], bt: int = 512) -> SimSession:
    turns = tuple(SimTurn(c, len(c) * bt, 10, 0.0) for c in chains)
    return SimSession(0, 0.0, turns)


def test_colocated_repeat_reuses_prefix_and_moves_no_kv() -> None:
    sim = Simulator(ClusterSpec(1, 1, 1), PROFILE, _Fixed(Action.COLOCATED_PREFILL, "h2", "h2"))
    res = sim.run([_session([(1, 2, 3), (1, 2, 3, 4)])])
    s = res.summary()
    assert s["requests"] == 2 and len(res.session_e2e_s) == 1
    assert s["reused_tokens"] == 3 * 512
    assert s["prefill_tokens"] == 3 * 512 + 512
    assert s["network_kv_gb"] == 0.0
    assert s["dup_factor"] == 1.0


def test_remote_prefill_ships_prompt_kv_and_duplicates_it() -> None:
    sim = Simulator(ClusterSpec(1, 1, 0), PROFILE, _Fixed(Action.REMOTE_PREFILL, "p0", "d1"))
    res = sim.run([_session([(1, 2, 3), (1, 2, 3, 4)])])
    # turn 1 ships 3 blocks; turn 2 ships only the block D lacks
    assert res.pd_kv_bytes == 4 * 512 * PROFILE.kv_bytes_per_token
    assert res.dup_factor == 2.0


def test_artifact_fetch_pulls_only_missing_blocks_from_the_source() -> None:
    sessions = [_session([(1, 2, 3, 4)])]
    sim = Simulator(ClusterSpec(0, 1, 1), PROFILE, _Fixed(Action.COLOCATED_PREFILL, "d0", "d0"))
    sim.run(sessions)
    sim.policy = _Fixed(Action.ARTIFACT_FETCH, "h1", "h1", source="d0")
    res = sim.run([_session([(1, 2, 3, 4, 5)])])
    assert res.fetch_kv_bytes == 4 * 512 * PROFILE.kv_bytes_per_token
    assert res.reused_tokens == 4 * 512 and res.prefill_tokens == 512


def test_eviction_takes_tails_first_and_forgets_holders() -> None:
    bb = 512 * PROFILE.kv_bytes_per_token
    spec = ClusterSpec(0, 0, 1, hbm_kv_bytes=3 * bb)
    sim = Simulator(spec, PROFILE, _Fixed(Action.COLOCATED_PREFILL, "h0", "h0"))
    sim.run([_session([(1, 2), (1, 2, 3, 4)])])
    assert set(sim.workers[0].cache) == {1, 2, 3}  # the chain's tail went first
    assert set(sim.holders) == {1, 2, 3} and 4 not in sim.owner
    sim.run([_session([(7, 8)])])
    # an older chain loses its tail before its head: caches stay prefix-closed
    assert set(sim.workers[0].cache) == {1, 7, 8}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_held_matches_brute_force_longest_prefix(data: st.DataObject) -> None:
    sim = Simulator(ClusterSpec(2, 2, 2), PROFILE, _Fixed(Action.COLOCATED_PREFILL, "h4", "h4"))
    rng = random.Random(data.draw(st.integers(0, 10_000)))
    for w in sim.workers:
        length = rng.randint(0, 8)
        sim._insert(w, tuple(range(1, length + 1)) + tuple(rng.sample(range(20, 30), 2)))
    chain = tuple(range(1, data.draw(st.integers(0, 10)) + 1))
    held = sim._held(chain)
    for w in sim.workers:
        expect = 0
        while expect < len(chain) and chain[expect] in w.cache:
            expect += 1
        assert held.depth(w.idx) == expect
    assert held.best == max((held.depth(w.idx) for w in sim.workers), default=0)


def test_generator_is_deterministic_per_seed() -> None:
    a = agentic_sessions(50, 1.0, seed=3)
    b = agentic_sessions(50, 1.0, seed=3)
    c = agentic_sessions(50, 1.0, seed=4)
    assert a == b and a != c
    for s in a:
        for prev, nxt in zip(s.turns, s.turns[1:], strict=False):
            assert nxt.chain[: len(prev.chain)] == prev.chain  # turns append


def test_oracle_eviction_keeps_blocks_that_will_be_reused() -> None:
    bb = 512 * PROFILE.kv_bytes_per_token
    spec = ClusterSpec(0, 0, 1, hbm_kv_bytes=3 * bb)
    fixed = _Fixed(Action.COLOCATED_PREFILL, "h0", "h0")
    # session A: (1, 2), then (5, 6, 7) arrives, then A returns; only the oracle knows it will
    sessions = [
        SimSession(0, 0.0, (SimTurn((1, 2), 1024, 1, 0.0), SimTurn((1, 2, 3), 1536, 1, 50.0))),
        SimSession(1, 1.0, (SimTurn((5, 6, 7), 1536, 1, 0.0),)),
    ]
    lru = Simulator(spec, PROFILE, fixed).run(sessions)
    oracle = Simulator(spec, PROFILE, fixed, oracle=True).run(sessions)
    assert lru.reused_tokens == 0
    assert oracle.reused_tokens == 1024


def test_oracle_keeps_caches_prefix_closed_when_protected_blocks_crowd_the_lru() -> None:
    bb = 512 * PROFILE.kv_bytes_per_token
    spec = ClusterSpec(0, 0, 1, hbm_kv_bytes=40 * bb)
    a = tuple(range(1, 31))
    sessions = [
        SimSession(0, 0.0, (SimTurn(a, 30 * 512, 1, 0.0), SimTurn((*a, 99), 31 * 512, 1, 100.0))),
        SimSession(1, 1.0, (SimTurn(tuple(range(200, 212)), 12 * 512, 1, 0.0),)),
        # arrives while A is idle: its lookup walks A's prefix, which must still be closed
        SimSession(2, 2.0, (SimTurn((*a[:20], 300), 21 * 512, 1, 0.0),)),
    ]
    sim = Simulator(spec, PROFILE, _Fixed(Action.COLOCATED_PREFILL, "h0", "h0"), oracle=True)
    res = sim.run(sessions)
    assert res.requests == 4
    assert res.reused_tokens >= 30 * 512 + 20 * 512  # C and A's return both found their prefix


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.integers(60, 300))
def test_caches_stay_prefix_closed_under_pressure(seed: int, oracle: bool, blocks: int) -> None:
    sessions = agentic_sessions(60, 5.0, seed=seed)
    spec = ClusterSpec(1, 1, 1, hbm_kv_bytes=blocks * 512 * PROFILE.kv_bytes_per_token)
    sim = Simulator(spec, PROFILE, _Fixed(Action.REMOTE_PREFILL, "p0", "h2"), oracle=oracle)
    sim.run(sessions)
    for s in sessions:
        for turn in s.turns:
            for w in sim.workers:
                held = [b in w.cache for b in turn.chain]
                assert held == sorted(held, reverse=True), (
                    "a cache holds a block without its parent"
                )


def test_state_migration_copies_the_session_owners_prefix() -> None:
    # the router's fetch (and the emulator's /ownerserve/kv/fetch) runs for migrations too
    sim = Simulator(ClusterSpec(0, 1, 1), PROFILE, _Fixed(Action.COLOCATED_PREFILL, "d0", "d0"))
    sim.run([_session([(1, 2, 3)])])
    sim.policy = _Fixed(Action.STATE_MIGRATION, "h1", "h1", source="d0")
    res = sim.run([_session([(1, 2, 3, 4)])])
    assert res.fetch_kv_bytes == 3 * 512 * PROFILE.kv_bytes_per_token
    assert res.prefill_tokens == 512 and {1, 2, 3, 4} <= set(sim.workers[1].cache)


def _two_sessions(gap_s: float) -> list[SimSession]:
    # B decodes 100 tokens on h0; A's 8k-token prefill lands on h0 while B decodes
    b = SimSession(0, 0.0, (SimTurn((1,), 512, 100, 0.0),))
    a = SimSession(1, gap_s, (SimTurn(tuple(range(10, 26)), 16 * 512, 1, 0.0),))
    return [b, a]


def test_colocated_prefill_stalls_the_running_decodes() -> None:
    fixed = _Fixed(Action.COLOCATED_PREFILL, "h0", "h0")
    alone = Simulator(ClusterSpec(0, 0, 1), PROFILE, fixed).run(_two_sessions(1e6))
    both = Simulator(ClusterSpec(0, 0, 1), PROFILE, fixed).run(_two_sessions(0.05))
    # session E2Es are listed in completion order: B (100 tokens) ends last
    b_alone, b_both = alone.session_e2e_s[0], max(both.session_e2e_s)
    prefill_a = PROFILE.prefill_s(16 * 512, 0)
    # B's decode made no progress while A's prefill computed (as in the emulated engine)
    assert b_both - b_alone > 0.9 * prefill_a
    assert b_both - b_alone < prefill_a + 0.05
    # A's prefill paid one decode step of B's batch per chunk
    chunks = -(-16 * 512 // PROFILE.max_batched_tokens)
    a_alone = PROFILE.prefill_s(16 * 512, 0) + PROFILE.decode_step_s(1, 16 * 512 + 1)
    assert min(both.session_e2e_s) >= a_alone + chunks * PROFILE.decode_step_s(1, 612) - 1e-9


def test_a_decode_on_another_worker_is_not_stalled() -> None:
    # B decodes on d0; A prefills on p0 (remote): B's time is unchanged
    sessions = _two_sessions(0.05)
    sim = Simulator(ClusterSpec(1, 1, 0), PROFILE, _Fixed(Action.REMOTE_PREFILL, "p0", "d1"))
    alone = Simulator(ClusterSpec(1, 1, 0), PROFILE, _Fixed(Action.REMOTE_PREFILL, "p0", "d1"))
    b_alone = alone.run(sessions[:1]).session_e2e_s[0]
    assert max(sim.run(sessions).session_e2e_s) == b_alone


def test_kv_usage_is_running_context_not_idle_cache() -> None:
    spy = _Spy(Action.COLOCATED_PREFILL, "h0", "h0", _h0_kv_usage)
    sim = Simulator(ClusterSpec(0, 0, 1), PROFILE, spy)
    # two sessions far apart: at the second arrival h0 caches the first but runs nothing
    sim.run([_session([(1, 2, 3)]), SimSession(1, 1e4, (SimTurn((7,), 512, 1, 0.0),))])
    assert spy.seen == [0.0, 0.0] and len(sim.workers[0].cache) == 4


def test_remote_prefill_gives_ownership_of_new_blocks_to_the_decode_worker() -> None:
    sim = Simulator(ClusterSpec(1, 1, 0), PROFILE, _Fixed(Action.REMOTE_PREFILL, "p0", "d1"))
    sim.run([_session([(1, 2, 3)])])
    assert all(sim.owner[b] == 1 for b in (1, 2, 3))  # d1, as the router's commit claims


def test_scraped_kv_usage_lags_by_up_to_one_scrape_period() -> None:
    # A decodes 1000 tokens from t=0; B arrives at 0.5 s (same scrape period), C at 2.5 s
    sessions = [
        SimSession(0, 0.0, (SimTurn((1,), 512, 1000, 0.0),)),
        SimSession(1, 0.5, (SimTurn((2,), 512, 1, 0.0),)),
        SimSession(2, 2.5, (SimTurn((3,), 512, 1, 0.0),)),
    ]
    for scrape, stale in ((0.0, False), (2.0, True)):
        spy = _Spy(Action.COLOCATED_PREFILL, "h0", "h0", _h0_kv_usage)
        Simulator(ClusterSpec(0, 0, 1, load_scrape_s=scrape), PROFILE, spy).run(sessions)
        seen = spy.seen
        assert seen[0] == 0.0 and seen[2] > 0.0
        assert (seen[1] == 0.0) == stale  # B sees the usage of the scrape at t=0


def test_policies_see_the_nic_backlog_of_each_senders_node() -> None:
    # p0 on node n0 sends a long prompt's KV to d1 on n1; a second session arrives at once
    spec = ClusterSpec(1, 1, 0, workers_per_node=1)
    spy = _Spy(Action.REMOTE_PREFILL, "p0", "d1", _nic_backlogs)
    sim = Simulator(spec, PROFILE, spy)
    seen = spy.seen
    chain = tuple(range(1, 33))  # 32 blocks of 512 tokens
    sim.run([_session([chain]), SimSession(1, 1e-6, (SimTurn((99, *chain), 512, 1, 0.0),))])
    assert seen[0] == {"p0": 0.0, "d1": 0.0}
    # the first transfer is queued on n0's NIC when the second plan is made (it leaves after
    # p0's prefill): p0's view shows it, the receiver's does not
    ship = PROFILE.link.transfer_s(
        32 * 512 * PROFILE.kv_bytes_per_token, transport=KVTransport.STORE_RDMA
    )
    assert seen[1]["d1"] == 0.0
    assert seen[1]["p0"] >= ship


class _Order(_Fixed):
    """A `_Fixed` that records which session each planned request is of."""

    def __init__(self) -> None:
        super().__init__(Action.COLOCATED_PREFILL, "h0", "h0")
        self.sessions: list[str | None] = []

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        self.sessions.append(request.session_id)
        return super().plan(request, cluster)


def test_a_subagent_arrives_when_its_parent_reaches_the_turn_that_spawns_it() -> None:
    turns = tuple(
        SimTurn(tuple(range(k + 1)), 512 * (k + 1), 5, 1.0 if k else 0.0) for k in (0, 1, 2)
    )
    parent = SimSession(0, 0.0, turns)
    # planned at t=0, spawned by the parent's turn 2 (after two 1 s tool gaps)
    sub = SimSession(1, 0.0, (SimTurn((0, 1, 9), 512 * 3, 5, 0.0),), spawned_at=(0, 2))
    order = _Order()
    res = Simulator(ClusterSpec(0, 0, 1), PROFILE, order).run([parent, sub])
    assert order.sessions == ["0", "0", "0", "1"]  # after the parent's turn 2, same instant
    assert res.sessions_completed == 2
    assert max(res.session_e2e_s) > 2.0  # the parent's, its gaps included
    assert min(res.session_e2e_s) < 0.5  # the subagent's, counted from its spawn


def _paths(cluster: ClusterView) -> dict[str, tuple[bool, KVTransport]]:
    return {w.worker_id: (w.kv_same_host, w.kv_transport) for w in cluster.workers}


def test_the_simulator_moves_kv_over_the_path_its_workers_views_name() -> None:
    # the same transfer as above over a store TCP path priced 100x slower than the link default
    tcp = TransportTiming(bps=PROFILE.link.inter_node_bps / 100, latency_s=0.01)
    prof = replace(PROFILE, link=replace(PROFILE.link, store_tcp=tcp))
    spec = ClusterSpec(1, 1, 0, workers_per_node=1, kv_transport=KVTransport.STORE_TCP)
    backlog = _Spy(Action.REMOTE_PREFILL, "p0", "d1", _nic_backlogs)
    chain = tuple(range(1, 33))
    second = SimSession(1, 1e-6, (SimTurn((99, *chain), 512, 1, 0.0),))
    Simulator(spec, prof, backlog).run([_session([chain]), second])
    nbytes = 32 * 512 * PROFILE.kv_bytes_per_token
    assert backlog.seen[1]["p0"] >= tcp.seconds(nbytes)
    assert tcp.seconds(nbytes) > 50 * PROFILE.link.transfer_s(nbytes, KVTransport.STORE_RDMA)
    paths = _Spy(Action.REMOTE_PREFILL, "p0", "d1", _paths)
    Simulator(spec, prof, paths).run([_session([chain])])
    assert paths.seen[0] == {
        "p0": (True, KVTransport.STORE_TCP),
        "d1": (True, KVTransport.STORE_TCP),
    }
