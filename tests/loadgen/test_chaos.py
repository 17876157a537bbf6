"""The chaos bench's pure parts: the seeded fault schedule, the slope of a series, which fault a
failed request is put down to, and the reading of the directory's block records."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from loadgen.chaos.load import Attempt, kept_plan
from loadgen.chaos.probe import _live_replica_lines, _replica_expiries
from loadgen.chaos.report import _fault_of, _kv_fetches
from loadgen.chaos.run import FaultRecord
from loadgen.chaos.schedule import (
    FAULT_KINDS,
    ScheduledFault,
    fault_schedule,
    sidecar_mode_for,
    slope_per_min,
    unsupported,
)

KINDS = ("worker_kill", "worker_stop", "redis_restart", "router_restart", "pd_drop")


def schedule(seed: int = 0, repeats: int = 2) -> tuple[ScheduledFault, ...]:
    return fault_schedule(
        KINDS, repeats, 10.0, 510.0, seed, victims=["h0", "h1", "d0"], prefill=["p0"], replica="B"
    )


def test_the_schedule_runs_every_fault_repeats_times_in_order_and_spaced() -> None:
    s = schedule()
    assert Counter(f.kind for f in s) == {k: 2 for k in KINDS}
    times = [f.at_s for f in s]
    assert times == sorted(times) and times[0] >= 10.0 and times[-1] < 510.0
    width = 500.0 / len(s)
    assert all(b - a >= width * 2 / 3 - 1e-6 for a, b in itertools.pairwise(times))
    assert all(a.kind != b.kind for a, b in itertools.pairwise(s))
    # each round has every kind once
    assert {f.kind for f in s[:5]} == {f.kind for f in s[5:]} == set(KINDS)


def test_the_schedule_is_the_seeds_and_picks_its_targets_by_kind() -> None:
    assert schedule(3) == schedule(3)
    assert schedule(3) != schedule(4)
    s = schedule(repeats=3)
    kills = [f.target for f in s if f.kind == "worker_kill"]
    assert sorted(kills) == ["d0", "h0", "h1"]  # each victim once before any repeats
    assert {f.target for f in s if f.kind == "pd_drop"} == {"p0"}
    assert {f.target for f in s if f.kind == "router_restart"} == {"B"}
    assert {f.target for f in s if f.kind == "redis_restart"} == {"redis"}


def test_the_schedule_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="unknown faults"):
        fault_schedule(["nope"], 1, 0, 10, 0, victims=["h0"], prefill=[], replica="B")
    with pytest.raises(ValueError, match="needs a worker"):
        fault_schedule(["pd_drop"], 1, 0, 10, 0, victims=["h0"], prefill=[], replica="B")
    with pytest.raises(ValueError, match="end_s > start_s"):
        fault_schedule(["worker_kill"], 1, 10, 10, 0, victims=["h0"], prefill=[], replica="B")
    assert "sidecar_kill" in FAULT_KINDS


def test_slope_per_min_is_the_least_squares_slope() -> None:
    assert slope_per_min([(0.0, 100.0), (60.0, 101.0), (120.0, 102.0)]) == pytest.approx(1.0)
    assert slope_per_min([(0.0, 5.0), (30.0, 9.0), (60.0, 5.0), (90.0, 9.0)]) == pytest.approx(1.6)
    assert slope_per_min([(0.0, 1.0), (1.0, 2.0)]) is None
    assert slope_per_min([(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)]) is None


def test_a_failure_is_put_down_to_the_fault_whose_window_it_overlaps() -> None:
    kill = FaultRecord(ScheduledFault(10.0, "worker_kill", "h0"), started_s=10.0, ended_s=14.0)
    stop = FaultRecord(ScheduledFault(40.0, "worker_stop", "h1"), started_s=40.0, ended_s=48.0)

    def at(sent: float, e2e: float) -> Attempt:
        return Attempt("s", 0, 0, 0, True, sent, e2e, "status", 502)

    assert _fault_of(at(5.0, 6.0), [kill, stop]) == "worker_kill"  # in flight at the kill
    assert _fault_of(at(18.5, 1.0), [kill, stop]) == "worker_kill"  # inside the grace after
    assert _fault_of(at(25.0, 1.0), [kill, stop]) == "none"
    assert _fault_of(at(47.0, 0.5), [kill, stop]) == "worker_stop"


def test_replica_lines_of_a_block_record_are_counted_while_live() -> None:
    record = "0123456789abcdef\x01\x00\nh0\tgpu\t2000\t1\nh1\tcpu\t2000\t1\nh0\tcpu\t500\t1\n"
    none: dict[str, tuple[str, int]] = {}
    assert _live_replica_lines(record, "h0", 1000, none) == 1
    assert _live_replica_lines(record, "h1", 1000, none) == 1
    assert _live_replica_lines(record, "h1", 3000, none) == 0
    assert _live_replica_lines("0123456789abcdef\x01\n", "h0", 0, none) == 0
    assert _live_replica_lines(None, "h0", 0, none) == 0
    assert _live_replica_lines(record, "h0", 0, none, tiers=("cpu", "ssd")) == 1
    assert _live_replica_lines(record, "h0", 1000, none, tiers=("cpu", "ssd")) == 0
    assert _replica_expiries(record, "h0", none, ("cpu", "ssd")) == [500]
    assert _replica_expiries(record, "h0", none, ("gpu", "cpu")) == [2000, 500]
    assert _replica_expiries(None, "h0", none, ("cpu",)) == []


def test_held_replica_lines_live_while_their_holder_does_at_their_incarnation() -> None:
    record = "0123456789abcdef\x00\nh0\tcpu\th77\t1\nh0\tssd\th5\t1\n"
    holders = {"h0\tcpu": ("77", 4000), "h0\tssd": ("6", 9000)}  # ssd: superseded by 6
    assert _live_replica_lines(record, "h0", 1000, holders) == 1
    assert _live_replica_lines(record, "h0", 5000, holders) == 0  # the holder's lease lapsed
    assert _live_replica_lines(record, "h0", 1000, {}) == 0  # no holder: nothing counts
    assert _replica_expiries(record, "h0", holders, ("cpu", "ssd")) == [4000, 0]


STORE_KINDS = ("worker_kill", "sidecar_kill", "store_master_kill", "redis_restart")


def test_the_kv_store_faults_pick_a_sidecar_each_round_and_the_master() -> None:
    s = fault_schedule(
        STORE_KINDS, 3, 10.0, 610.0, 1, victims=["h0", "h1", "d0"], prefill=["p0"],
        replica="B", sidecars=["h0", "h1", "h2"],
    )  # fmt: skip
    assert Counter(f.kind for f in s) == {k: 3 for k in STORE_KINDS}
    assert sorted(f.target for f in s if f.kind == "sidecar_kill") == ["h0", "h1", "h2"]
    assert {f.target for f in s if f.kind == "store_master_kill"} == {"mooncake_master"}
    assert all(a.kind != b.kind for a, b in itertools.pairwise(s))
    default = fault_schedule(
        ["sidecar_kill"], 2, 0.0, 10.0, 1, victims=["h0", "h1"], prefill=[], replica="B"
    )
    assert sorted(f.target for f in default) == ["h0", "h1"]  # without sidecars: the victims
    with pytest.raises(ValueError, match="needs a worker"):
        fault_schedule(
            ["sidecar_kill"], 1, 0, 10, 0, victims=["h0"], prefill=[], replica="B", sidecars=[]
        )


def test_the_kv_store_faults_run_only_on_a_topology_that_has_the_processes() -> None:
    kinds = ["worker_kill", "sidecar_kill", "store_master_kill"]
    assert set(unsupported(kinds, "off")) == {"sidecar_kill", "store_master_kill"}
    assert set(unsupported(kinds, "tcp")) == {"store_master_kill"}
    assert unsupported(kinds, "store") == {}
    assert "--kv-sidecars store" in unsupported(kinds, "tcp")["store_master_kill"]
    assert sidecar_mode_for(kinds) == "store"
    assert sidecar_mode_for(["sidecar_kill", "redis_restart"]) == "tcp"
    assert sidecar_mode_for(["worker_kill"]) == "off"


def test_fetch_plans_are_counted_fetched_cut_or_fallen_back_by_fault() -> None:
    kill = FaultRecord(ScheduledFault(10.0, "sidecar_kill", "h0"), started_s=10.0, ended_s=20.0)

    def answered(sent: float, header: str) -> Attempt:
        return Attempt("s", 0, 0, 0, False, sent, 0.5, "ok", 200, plan=kept_plan(header))

    fetched = "policy=ownerserve;action=artifact_fetch;p=h1;d=h1;src=h0;cost=0.1;fetched=1"
    cut = (
        "action=artifact_fetch;p=h1;d=h1;src=h0;t_queue=0;fetched=0;"
        "fallback=colocated;reason=kv_transfer_failed;gave_up=kv_transfer_failed:h1"
    )
    attempts = [
        answered(1.0, fetched),
        answered(12.0, cut),
        answered(13.0, "action=decode_continuation;p=h0;d=h0"),
        Attempt("s", 1, 0, 0, False, 14.0, 1.0, "status", 502),
    ]
    assert kept_plan(cut) == (
        "action=artifact_fetch;p=h1;d=h1;src=h0;fetched=0;fallback=colocated;"
        "reason=kv_transfer_failed"
    )
    got = _kv_fetches(attempts, [kill])
    assert (got["plans"], got["fetched"], got["cut_recomputed"], got["fallback"]) == (2, 1, 1, 1)
    assert got["by_fault"]["sidecar_kill"] == {
        "plans": 1, "fetched": 0, "cut_recomputed": 1, "fallback": 1
    }  # fmt: skip
    assert got["by_fault"]["none"]["fetched"] == 1
