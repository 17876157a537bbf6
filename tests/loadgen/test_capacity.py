"""The capacity benchmark's pure parts: rated workloads, the KV demand and sizing, the SLO check,
client-side 429s and the router's admission queue gauge."""

from __future__ import annotations

import pytest

from loadgen.capacity import (
    KVDemand,
    capacity_point,
    default_num_blocks,
    goodput_table,
    kv_demand,
    session_good,
    sweep_workload,
)
from loadgen.client import RequestRecord, RunResult, SessionRecord
from loadgen.metrics import ADMISSION_QUEUED, metric_sum, parse_prometheus
from loadgen.report import summarize
from ownerserve.profiles import load_profile

PROFILE = load_profile("h100-llama3-8b")


def test_every_rate_replays_the_same_sessions_only_closer_together() -> None:
    slow = sweep_workload("agentic-long", 3, 0.02, 6, 10.0, 0.01)
    fast = sweep_workload("agentic-long", 3, 0.02, 6, 40.0, 0.01)
    by_id = {s.session_id: s for s in fast.sessions}
    assert sorted(by_id) == sorted(s.session_id for s in slow.sessions)
    assert all(s.steps == by_id[s.session_id].steps for s in slow.sessions)
    mains = [
        (a.start_s, by_id[a.session_id].start_s)
        for a in slow.sessions
        if a.kind == "agentic-long" and a.start_s > 0
    ]
    assert mains and all(a == pytest.approx(4 * b, abs=1e-4) for a, b in mains)
    # rate is main sessions per minute of wall time: 6 sessions at 40/min arrive in ~9 s
    last_main = max(s.start_s for s in fast.sessions if s.kind == "agentic-long")
    assert 2.0 < last_main < 25.0
    with pytest.raises(ValueError, match="unknown workload"):
        sweep_workload("mixed", 0, 1.0, 1, 1.0, 1.0)


def test_kv_demand_counts_shared_prefixes_once_and_grows_with_the_rate() -> None:
    slow = kv_demand(sweep_workload("agentic-long", 0, 0.02, 6, 2.0, 0.01), PROFILE, 1.0, "m")
    fast = kv_demand(sweep_workload("agentic-long", 0, 0.02, 6, 600.0, 0.01), PROFILE, 1.0, "m")
    # the prompts do not depend on the rate, so neither does the unbounded cache's work
    assert slow.total_blocks == fast.total_blocks
    assert sum(slow.ideal_new_tokens.values()) == sum(fast.ideal_new_tokens.values())
    assert slow.working_set_blocks < fast.working_set_blocks <= fast.total_blocks + 6 * 64
    w = sweep_workload("agentic-long", 0, 0.02, 6, 600.0, 0.01)
    first = [s for s in w.sessions if s.kind == "agentic-long"]
    a, b = first[0], next(s for s in first[1:] if s.group == first[0].group)
    # the second session of a repository computes less of its first prompt than the first one
    assert fast.ideal_new_tokens[(b.session_id, 0)] < fast.ideal_new_tokens[(a.session_id, 0)]
    # a later turn computes only what it appended (plus the partial last block)
    assert all(fast.ideal_new_tokens[(a.session_id, k)] < 2_000 for k in range(1, len(a.steps)))
    # alone, a session computes its whole first prompt, then what it appended
    assert fast.alone_new_tokens[(b.session_id, 0)] > fast.ideal_new_tokens[(b.session_id, 0)]
    assert all(
        fast.ideal_new_tokens[(a.session_id, k)] <= fast.alone_new_tokens[(a.session_id, k)] < 2_000
        for k in range(1, len(a.steps))
    )


def test_default_num_blocks_sizes_hbm_to_a_third_of_the_working_set_but_fits_a_session() -> None:
    demand = KVDemand(working_set_blocks=12_000, total_blocks=20_000, largest_session_blocks=400,
                      ideal_new_tokens={})  # fmt: skip
    assert default_num_blocks(demand, 4) == 1_000
    assert default_num_blocks(demand, 4, pressure=2.0) == 1_500
    # a worker must hold the largest session whatever the pressure asks
    big = KVDemand(12_000, 20_000, 1_500, {})
    assert default_num_blocks(big, 4) == 1_500


def _req(sid: str, step: int, ttft: float | None, status: int = 200) -> RequestRecord:
    error = None if status == 200 else f"HTTP {status}: busy"
    return RequestRecord(sid, step, "k", "turn", 0.0, 1.0, ttft, (), 100, 10, 0, status, error)


def _session(sid: str, done: int, total: int, error: str | None = None) -> SessionRecord:
    return SessionRecord(sid, "k", "g", 0.0, 0.0, 5.0, total, done, 0.0, error)


def test_a_session_is_good_when_complete_and_its_p90_ttft_meets_the_slo() -> None:
    requests = (
        *(_req("fast", k, 0.1) for k in range(10)),
        *(_req("slow", k, 0.1 if k < 8 else 3.0) for k in range(10)),
        _req("cut", 0, 0.1),
        _req("refused", 0, None, status=429),
    )
    sessions = (
        _session("fast", 10, 10),
        _session("slow", 10, 10),
        _session("cut", 1, 5, "cancelled: run time limit reached"),
        _session("refused", 0, 3, "HTTP 429: busy"),
    )
    result = RunResult("ownerserve", "w", "t", "now", 10.0, requests, sessions, True)
    assert session_good(result, speed=1.0, slo_ttft_p90_s=2.0) == {"fast"}
    # the SLO is on emulated time: at speed 0.5 a wall TTFT of 3 s is 1.5 emulated seconds
    assert session_good(result, speed=0.5, slo_ttft_p90_s=2.0) == {"fast", "slow"}
    summary = summarize(result)
    assert summary.rejected_429 == 1 and summary.errors == 1
    demand = KVDemand(0, 0, 0, {("fast", k): 50 for k in range(10)})
    point = capacity_point("ownerserve", 30.0, result, summary, demand, 1.0, 2.0)
    assert point.sessions == 4 and point.sessions_good == 1 and point.sessions_completed == 2
    assert point.goodput_per_min == pytest.approx(7.5)
    assert point.rejected_429 == 1 and point.errors == 0
    assert point.prefill_tokens_ideal == 500 and point.recompute_ratio is None
    assert "| ownerserve | 7.5 |" in goodput_table([point])


def test_the_router_queue_gauge_is_read_from_its_metrics() -> None:
    text = (
        "ownerserve_admission_queued 3\n"
        'ownerserve_admission_rejected_total{reason="queue_full"} 7\n'
    )
    assert metric_sum(parse_prometheus(text), ADMISSION_QUEUED) == 3
    assert metric_sum(parse_prometheus("other 1\n"), ADMISSION_QUEUED) is None
