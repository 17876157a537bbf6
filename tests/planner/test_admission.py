"""Admission's rules (`planner.admission`) without a router or a simulator: the watermarks'
hysteresis, when the cluster is full, who goes at once, who is paused, the queue's release
order (least attained service, aging, a subagent as part of its spawner's program), what
waits for room for programs and what is refused; every clock is the test's `now`."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.admission import (
    AdmissionQueue,
    AdmissionSettings,
    Queued,
    admits_now,
    cluster_full,
    is_started,
    kv_paused,
    needs_programs_room,
    pauses_at_tool_boundary,
    programs_closed,
    release_key,
    release_order,
    resident_on,
    timed_out,
)

S = AdmissionSettings()
"""The defaults: watermarks 0.95 / 0.80, 1024 new requests, 60 s wait bound, 10 s aging."""
PAST_KNEE = AdmissionSettings(pause_watermark=1.2)


def _never() -> bool:
    raise AssertionError("asked, though the rule did not need it")


# --- the workers ----------------------------------------------------------------------------------


def test_a_worker_pauses_at_the_high_watermark_and_resumes_only_below_the_low_one() -> None:
    paused = False
    seen = []
    for usage in (0.94, 0.95, 0.85, 0.80, 0.79, 0.94):
        paused = kv_paused(paused, usage, S)
        seen.append(paused)
    assert seen == [False, True, True, True, False, False]


def test_a_worker_closes_to_programs_with_hysteresis_unless_one_session_fills_it() -> None:
    closed = False
    seen = []
    for share, sessions in ((0.9, 3), (0.95, 3), (0.81, 3), (0.99, 1), (0.9, 2), (0.79, 2)):
        closed = programs_closed(closed, share, sessions, S)
        seen.append(closed)
    # one session at 0.99 opens it (and forgets it was closed): 0.9 of two is under the high
    assert seen == [False, True, True, False, False, False]
    assert not programs_closed(False, 5.0, 0, S) and programs_closed(False, 0.95, 2, S)


def test_the_cluster_is_full_at_the_pause_watermark_until_under_it_by_high_minus_low() -> None:
    assert not cluster_full(False, 10.0, S)  # no pause watermark (the default): never
    full = False
    seen = []
    for share in (1.19, 1.2, 1.06, 1.05, 1.04, 1.1):
        full = cluster_full(full, share, PAST_KNEE)
        seen.append(full)
    assert seen == [False, True, True, True, False, False]  # off below 1.2 − 0.15


# --- a request ------------------------------------------------------------------------------------


def test_a_subagent_of_a_known_session_is_part_of_a_program_under_way() -> None:
    assert is_started(10, False) and is_started(0, True) and not is_started(0, False)


def test_a_subagent_without_service_is_resident_on_its_spawners_kv() -> None:
    assert resident_on("w1", 0, lambda: "w2") == "w1"  # its own KV first
    assert resident_on(None, 0, lambda: "w2") == "w2"
    assert resident_on(None, 0, None) is None
    # served itself, its own KV decides (the spawner's is not asked)
    assert resident_on(None, 5, lambda: pytest.fail("spawner asked")) is None


def test_a_started_session_is_paused_only_over_the_high_watermark_past_the_knee() -> None:
    assert pauses_at_tool_boundary(100, lambda: 0.95, lambda: True, PAST_KNEE)
    assert not pauses_at_tool_boundary(100, lambda: 0.95, lambda: False, PAST_KNEE)
    # under the watermark, or never served: the cluster is not even looked at
    assert not pauses_at_tool_boundary(100, lambda: 0.94, _never, PAST_KNEE)
    assert not pauses_at_tool_boundary(0, lambda: 2.0, _never, PAST_KNEE)


def test_a_request_goes_at_once_past_nothing_queued_or_as_resident_when_there_is_room() -> None:
    room = {True: True, False: False}  # KV headroom, no worker open to programs
    assert admits_now(False, True, room.__getitem__)
    assert not admits_now(False, False, room.__getitem__)
    assert admits_now(True, True, room.__getitem__)  # a resident one passes the queue
    assert not admits_now(True, False, lambda r: pytest.fail("room asked"))
    assert admits_now(False, False, lambda r: True)


def test_what_waits_for_room_for_programs() -> None:
    now = 100.0
    assert needs_programs_room(False, 0.0, now, _never, S)  # a new session's never ages
    # a started one: KV headroom is enough once aged below the knee, or past the wait bound
    assert needs_programs_room(True, 95.0, now, _never, S)
    assert not needs_programs_room(True, 90.0, now, lambda: False, S)
    assert needs_programs_room(True, 90.0, now, lambda: True, S)
    assert not needs_programs_room(True, 40.0, now, _never, S)


def test_only_a_new_sessions_request_is_refused_for_its_wait() -> None:
    assert timed_out(False, 39.9, 100.0, S) and not timed_out(False, 40.0, 100.0, S)
    assert not timed_out(True, 0.0, 1e6, S)


def test_the_release_key_orders_aged_then_least_served_then_new() -> None:
    keys = [
        release_key(True, 95.0, 7, 4, 100.0, 10.0),
        release_key(False, 0.0, 0, 1, 100.0, 10.0),  # new: never aged
        release_key(True, 89.0, 10**9, 3, 100.0, 10.0),  # aged, however served
        release_key(True, 99.0, 3, 5, 100.0, 10.0),
    ]
    assert sorted(keys) == [(0, 0, 3), (1, 3, 5), (1, 7, 4), (2, 0, 1)]


# --- the queue ------------------------------------------------------------------------------------


def _queue(s: AdmissionSettings = S) -> AdmissionQueue[str]:
    return AdmissionQueue(s)


def _all(
    q: AdmissionQueue[str], now: float, kv_only: bool = True, programs: bool = True
) -> list[str]:
    """Release everything that may go at `now` with that room, in order."""
    out = []
    while (e := q.next(now, lambda g, k: kv_only if k else programs, lambda: False)) is not None:
        out.append(e.key)
    return out


def test_started_sessions_go_least_served_first_then_new_ones_first_come() -> None:
    q = _queue()
    for i, (key, attained) in enumerate((("heavy", 5000), ("light", 10), ("mid", 100))):
        q.add(key, float(i), started=True, attained=attained)
    q.add("new", 3.0, started=False)
    q.add("newer", 4.0, started=False)
    assert len(q) == 5 and q.new_waiting == 2
    assert _all(q, 5.0) == ["light", "mid", "heavy", "new", "newer"]
    assert not q and q.new_waiting == 0


def test_requests_queued_past_the_aging_bound_go_first_oldest_first() -> None:
    q = _queue()
    q.add("heavier", 80.0, started=True, attained=9000)
    q.add("heavy", 85.0, started=True, attained=5000)
    q.add("light", 95.0, started=True, attained=1)
    q.add("new", 50.0, started=False)  # a new one does not age
    assert _all(q, 100.0) == ["heavier", "heavy", "light", "new"]


def test_a_subagent_goes_first_among_started_sessions_with_no_service_of_its_own() -> None:
    q = _queue()
    q.add("back", 0.0, started=True, attained=500)
    q.add("orphan", 0.0, started=is_started(0, False))
    q.add("sub", 0.0, started=is_started(0, True))
    assert _all(q, 1.0) == ["sub", "back", "orphan"]


def test_a_sessions_attained_service_is_looked_up_again_when_it_grew() -> None:
    q = _queue()
    attained = {"a": 10, "b": 20}
    q.add("a", 0.0, started=True, attained=10)
    q.add("b", 0.0, started=True, attained=20)
    attained["a"] = 30  # another request of "a" was answered while this one waits
    e = q.next(1.0, lambda g, k: True, lambda: False, attained.__getitem__)
    assert e is not None and e.key == "b"


def test_with_kv_headroom_only_the_aged_below_the_knee_and_the_past_the_bound_go() -> None:
    q = _queue()
    q.add("old", 0.0, started=True, attained=900)  # aged at 10, bound at 60
    q.add("young", 5.0, started=True, attained=1)
    q.add("new", 7.0, started=False)
    # KV headroom, no worker open to programs
    assert _all(q, 8.0, programs=False) == []
    full = {"full": True}

    def room(group: Hashable, kv_only: bool) -> bool:
        return kv_only

    assert q.next(12.0, room, lambda: full["full"]) is None  # past the knee: not by aging
    full["full"] = False
    e = q.next(12.0, room, lambda: full["full"])  # below it, aged: KV headroom is enough
    assert e is not None and e.key == "old"
    assert q.next(64.0, room, lambda: True) is None  # "young" not yet past the bound
    e = q.next(65.1, room, lambda: True)
    assert e is not None and e.key == "young"
    assert q.next(1000.0, room, lambda: True) is None  # "new" waits for room (or its 429)
    assert [x.key for x in q.timed_out(1000.0)] == ["new"]


def test_nothing_goes_without_kv_headroom() -> None:
    q = _queue()
    q.add("s", 0.0, started=True, attained=1)
    assert q.next(100.0, lambda g, k: False, _never) is None and len(q) == 1


def test_past_the_bound_but_not_aged_the_least_served_goes_first() -> None:
    q = _queue(AdmissionSettings(max_queue_wait_s=5.0, aging_s=30.0))
    q.add("a", 0.0, started=True, attained=50)
    q.add("b", 1.0, started=True, attained=10)
    q.add("c", 9.0, started=True, attained=1)  # not yet past the bound at 10
    assert _all(q, 10.0, programs=False) == ["b", "a"]


def test_the_bound_on_new_requests_counts_new_sessions_only() -> None:
    q = _queue(AdmissionSettings(max_queued=1))
    assert not q.refuses(False)
    q.add("n1", 0.0, started=False)
    assert q.refuses(False) and not q.refuses(True)
    q.add("s1", 0.0, started=True, attained=5)
    assert q.remove("n1") is not None and not q.refuses(False)
    assert q.remove("n1") is None


def test_new_requests_past_the_wait_bound_are_taken_out_oldest_first() -> None:
    q = _queue()
    q.add("a", 0.0, started=False)
    q.add("s", 0.0, started=True, attained=1)
    q.add("b", 30.0, started=False)
    assert q.timed_out(60.0) == []  # 60 s is not past the bound
    assert [e.key for e in q.timed_out(60.5)] == ["a"]
    assert [e.key for e in q.timed_out(91.0)] == ["b"]
    assert len(q) == 1 and q.new_waiting == 0


def test_groups_are_released_by_one_order_each_where_its_room_is() -> None:
    q = _queue()
    q.add("m1-new", 0.0, started=False, group="m1")
    q.add("m2-early", 1.0, started=True, attained=1, group="m2")
    q.add("m1-late", 2.0, started=True, attained=1, group="m1")
    assert sorted(map(str, q.groups())) == ["m1", "m2"]
    order = []
    while (e := q.next(3.0, lambda g, k: True, lambda: False)) is not None:
        order.append(e.key)
    assert order == ["m2-early", "m1-late", "m1-new"]
    q.add("m1", 4.0, started=True, group="m1")
    q.add("m2", 5.0, started=True, group="m2")
    e = q.next(6.0, lambda g, k: g == "m2", lambda: False)  # m1's workers are full
    assert e is not None and e.key == "m2"
    assert q.groups() == ["m1"]


# --- the queue against its definition -------------------------------------------------------------


def _reference(
    live: list[Queued[str]],
    now: float,
    room: dict[tuple[Hashable, bool], bool],
    full: bool,
    attained: dict[str, int],
    s: AdmissionSettings,
) -> str | None:
    """The first of `live` in `release_order` whose room is there, by the rules alone."""
    for e in release_order(live, now, s.aging_s, attained.__getitem__):
        kv_only = not needs_programs_room(e.started, e.queued_at, now, lambda: full, s)
        if room[(e.group, kv_only)]:
            return e.key
    return None


def _lookup(room: dict[tuple[Hashable, bool], bool]) -> Callable[[Hashable, bool], bool]:
    return lambda g, k: room[(g, k)]


def _const(value: bool) -> Callable[[], bool]:
    return lambda: value


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_queue_releases_what_the_release_order_and_the_rooms_say(seed: int) -> None:
    rng = random.Random(seed)
    s = AdmissionSettings(
        aging_s=rng.choice([0.0, 2.0, 10.0, 30.0]),
        max_queue_wait_s=rng.choice([1.0, 5.0, 20.0]),  # shorter than aging_s sometimes
        max_queued=rng.choice([2, 5, 100]),
    )
    groups = ["m1", "m2"][: rng.randint(1, 2)]
    q: AdmissionQueue[str] = AdmissionQueue(s)
    entries: dict[str, Queued[str]] = {}
    attained: dict[str, int] = {}
    now = 0.0
    for step in range(60):
        now += rng.choice([0.0, 0.5, 1.0, 3.0, 7.0])
        for key in attained:
            if rng.random() < 0.1:
                attained[key] += rng.randint(1, 50)  # service only grows
        op = rng.random()
        if op < 0.45:
            key = f"r{step}"
            started = rng.random() < 0.6
            if q.refuses(started):
                assert not started and q.new_waiting >= s.max_queued
                continue
            attained[key] = rng.randint(1, 100) if started and rng.random() < 0.8 else 0
            entries[key] = q.add(
                key, now, started=started, attained=attained[key], group=rng.choice(groups)
            )
        elif op < 0.55 and entries:
            key = rng.choice(sorted(entries))
            assert q.remove(key) is entries.pop(key)
        elif op < 0.65:
            gone = [e.key for e in q.timed_out(now)]
            expect = [k for k, e in entries.items() if timed_out(e.started, e.queued_at, now, s)]
            assert sorted(gone) == sorted(expect)
            for k in gone:
                del entries[k]
        else:
            room: dict[tuple[Hashable, bool], bool] = {}
            for g in groups:
                kv = rng.random() < 0.8
                room[(g, True)] = kv
                room[(g, False)] = kv and rng.random() < 0.5
            full = rng.random() < 0.5
            want = _reference(list(entries.values()), now, room, full, attained, s)
            got = q.next(now, _lookup(room), _const(full), attained.__getitem__)
            assert (got.key if got else None) == want, (seed, step)
            if got is not None:
                del entries[got.key]
        assert len(q) == len(entries)
        assert q.new_waiting == sum(not e.started for e in entries.values())


def test_the_readme_states_every_rule() -> None:
    import planner.admission as rules

    readme = Path(__file__).resolve().parents[2] / "planner" / "README.md"
    section = readme.read_text().split("## Admission (`admission.py`)", 1)[1].split("\n## ", 1)[0]
    for name in rules.__all__:
        if name not in ("AdmissionSettings", "Queued", "release_order"):
            assert name in section, name
