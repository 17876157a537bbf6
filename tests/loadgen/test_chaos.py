"""The chaos bench's pure parts: the seeded fault schedule, the slope of a series, which fault a
failed request is put down to, and the reading of the directory's block records."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from loadgen.chaos.load import Attempt
from loadgen.chaos.probe import _live_replica_lines
from loadgen.chaos.report import _fault_of
from loadgen.chaos.run import FaultRecord
from loadgen.chaos.schedule import FAULT_KINDS, ScheduledFault, fault_schedule, slope_per_min

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
    assert _live_replica_lines(record, "h0", now_ms=1000) == 1
    assert _live_replica_lines(record, "h1", now_ms=1000) == 1
    assert _live_replica_lines(record, "h1", now_ms=3000) == 0
    assert _live_replica_lines("0123456789abcdef\x01\n", "h0", now_ms=0) == 0
    assert _live_replica_lines(None, "h0", now_ms=0) == 0
