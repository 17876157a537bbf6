"""The sessions' working sets (planner.workingset): counting, tool-gap retention and its
prediction, moves between workers, expiry and forgetting."""

from __future__ import annotations

import pytest

from planner.workingset import RetentionConfig, WorkingSets


def test_in_flight_then_kept_through_a_short_gap_then_released() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, max_gap_s=60.0))
    ws.started("s", "w0", 1000, now=0.0)
    assert ws.tokens("w0", 0.0) == 1000
    assert ws.home("s", 0.0) == ("w0", 1000)
    ws.ended("s", 1300, now=1.0)  # prompt + output
    # kept for factor x the prior gap: 4 s
    assert ws.tokens("w0", 4.9) == 1300
    assert ws.home("s", 4.9) == ("w0", 1300)
    assert ws.tokens("w0", 5.0) == 0
    assert ws.home("s", 5.0) == (None, 0)


def test_gap_predicted_long_releases_at_once() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, max_gap_s=10.0))
    ws.started("s", "w0", 100, now=0.0)
    ws.ended("s", 120, now=1.0)
    ws.started("s", "w0", 200, now=101.0)  # a 100 s gap: the average is now 100 s
    assert ws.predicted_gap_s("s") == pytest.approx(100.0)
    ws.ended("s", 220, now=102.0)
    assert ws.keep_s("s") == 0.0
    assert ws.tokens("w0", 102.0) == 0


def test_gap_average_per_session_and_per_tool() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, alpha=0.5))
    ws.started("a", "w0", 10, now=0.0)
    ws.ended("a", 10, now=0.0, tool="pytest")
    ws.started("a", "w0", 10, now=8.0, after_tool="pytest")  # 8 s after pytest
    assert ws.predicted_gap_s("a") == pytest.approx(8.0)
    ws.ended("a", 10, now=8.0)
    ws.started("a", "w0", 10, now=10.0)  # 2 s after an answer without a tool
    assert ws.predicted_gap_s("a") == pytest.approx(5.0)  # 0.5 * 8 + 0.5 * 2
    # another session that calls pytest is predicted from the tool's average
    ws.started("b", "w1", 10, now=0.0)
    ws.ended("b", 10, now=1.0, tool="pytest")
    assert ws.predicted_gap_s("b") == pytest.approx(8.0)
    assert ws.predicted_gap_s("never-seen") == 2.0


def test_a_session_moves_with_its_request_and_overlapping_requests_count_once() -> None:
    ws = WorkingSets()
    ws.started("s", "w0", 500, now=0.0)
    ws.ended("s", 600, now=1.0)
    ws.started("s", "w1", 700, now=1.5)
    assert ws.tokens("w0", 1.5) == 0
    assert ws.tokens("w1", 1.5) == 700
    assert (ws.sessions("w0", 1.5), ws.sessions("w1", 1.5)) == (0, 1)
    ws.started("s", "w1", 800, now=1.6)  # a second request of the session (a fork)
    assert ws.tokens("w1", 1.6) == 800
    assert ws.sessions("w1", 1.6) == 1
    ws.ended("s", 900, now=2.0)
    assert ws.tokens("w1", 2.0) == 900  # one still in flight
    ws.failed("s", now=2.1)
    assert ws.tokens("w1", 2.1) == 0  # a failure releases the session (its KV is unknown)
    assert ws.sessions("w1", 2.1) == 0
    ws.ended("s", 1, now=2.2)  # nothing in flight any more: ignored
    assert ws.tokens("w1", 2.2) == 0
    assert ws.home("s", 2.2) == (None, 0)


def test_forget_worker_and_idle_sessions() -> None:
    ws = WorkingSets(RetentionConfig(idle_forget_s=100.0))
    ws.started("a", "w0", 10, now=0.0)
    ws.started("b", "w1", 20, now=0.0)
    ws.started("a2", "w1", 30, now=0.0)
    assert (ws.sessions("w0", 0.0), ws.sessions("w1", 0.0)) == (1, 2)
    ws.forget_worker("w0")
    assert ws.tokens("w0", 0.0) == 0
    assert ws.tokens("w1", 0.0) == 50
    assert (ws.sessions("w0", 0.0), ws.sessions("w1", 0.0)) == (0, 2)
    ws.ended("b", 20, now=1.0)
    ws.ended("a2", 30, now=1.0)
    ws.ended("a", 10, now=1.0)
    # a, b and a2 idle past the horizon: forgotten, one a touch
    for s in ("c", "d", "e"):
        ws.started(s, "w2", 5, now=500.0)
    assert len(ws) == 3


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        RetentionConfig(alpha=0.0)
    with pytest.raises(ValueError):
        RetentionConfig(max_gap_s=-1.0)


def test_a_short_predicted_gap_is_kept_at_least_the_prior() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0))
    ws.started("s", "w0", 100, now=0.0)
    ws.ended("s", 100, now=0.0)
    ws.started("s", "w0", 100, now=0.01)  # a 10 ms gap
    ws.ended("s", 100, now=0.02)
    assert ws.predicted_gap_s("s") == pytest.approx(0.01)
    assert ws.keep_s("s") == 4.0  # 2 × max(0.01, 2)
    assert ws.tokens("w0", 3.9) == 100


def test_released_sessions_teach_the_expected_growth_of_new_ones() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=1.0, factor=1.0, alpha=0.5))
    assert ws.growth(100) == 0  # nothing released yet: no estimate
    ws.started("a", "w0", 4000, now=0.0)
    ws.ended("a", 6000, now=0.0)  # kept 1 s
    assert ws.growth(100) == 0
    ws.tokens("w0", 1.5)  # expired: released at 6000 tokens
    assert ws.peak_tokens == 6000
    assert ws.growth(1000) == 5000 and ws.growth(7000) == 0
    # a gap predicted long releases at once, and is learnt too
    ws2 = WorkingSets(RetentionConfig(prior_gap_s=100.0, max_gap_s=10.0))
    ws2.started("b", "w0", 100, now=0.0)
    ws2.ended("b", 2000, now=0.0)
    assert ws2.peak_tokens == 2000


def test_release_stops_counting_an_idle_session_but_not_one_in_flight() -> None:
    ws = WorkingSets()
    ws.started("a", "w0", 1000, 0.0)
    ws.started("b", "w0", 500, 0.0)
    ws.ended("a", 1100, 1.0)
    ws.release("b", 1.0)  # in flight: still counted
    assert ws.tokens("w0", 1.0) == 1600
    ws.release("a", 1.5)  # idle inside its keep time: paused, no longer counted
    assert ws.tokens("w0", 1.5) == 500 and ws.home("a", 1.5) == (None, 0)
    assert ws.peak_tokens == 0  # a pause is not the end of a session: no growth learnt
    ws.release("a", 1.6)  # twice: nothing more
    assert ws.tokens("w0", 1.6) == 500
    ws.started("a", "w1", 1200, 3.0)  # it resumes elsewhere
    assert ws.home("a", 3.0) == ("w1", 1200) and ws.tokens("w0", 3.0) == 500


def test_a_subagents_prefix_held_by_its_spawner_on_the_same_worker_counts_once() -> None:
    ws = WorkingSets()
    ws.started("parent", "w0", 1000, now=0.0)
    ws.started("sub", "w0", 1200, now=0.0)
    ws.shares("sub", "parent", 1000)
    assert ws.tokens("w0", 0.0) == 1200  # the engine keeps the 1,000 shared tokens once
    assert ws.sessions("w0", 0.0) == 2
    assert ws.home("sub", 0.0) == ("w0", 1200)  # its own KV, for what moving it would cost
    ws.ended("sub", 1500, now=1.0)  # grew by its output: only that is its own
    assert ws.tokens("w0", 1.0) == 1500
    ws.failed("parent", now=1.0)
    # with the spawner counted nowhere, or elsewhere, the whole prompt counts
    ws.started("sub", "w0", 1600, now=2.0)
    ws.shares("sub", "parent", 1000)
    ws.started("other", "w1", 1200, now=2.0)
    ws.shares("other", "sub", 1000)
    assert ws.tokens("w0", 2.0) == 1600 and ws.tokens("w1", 2.0) == 1200
    ws.started("more", "w0", 1700, now=2.0)
    ws.shares("more", "sub", 5000)
    assert ws.tokens("w0", 2.0) == 1600 + 100  # never more than the spawner holds


def test_first_answers_of_sessions_that_never_come_back_stop_being_kept() -> None:
    # single-request sessions (a chat or completion trace): each first answer's session does
    # not return within the window (factor x prior gap = 4 s), so the return rate falls and
    # a first answer's KV is held for less and less, then not at all
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, return_alpha=0.5))
    assert ws.return_rate == 1.0
    for i in range(8):
        t = 10.0 * i
        ws.started(f"s{i}", "w0", 1000, now=t)
        ws.ended(f"s{i}", 1100, now=t + 1.0)
        assert ws.keep_s(f"s{i}") == pytest.approx(4.0 * ws.return_rate)
    ws.tokens("w0", 100.0)  # the last window closes
    assert ws.return_rate == pytest.approx(0.5**8)
    ws.started("last", "w0", 1000, now=100.0)
    ws.ended("last", 1100, now=101.0)
    assert ws.tokens("w0", 101.1) == 0  # kept 4 s x 0.004: gone within 16 ms


def test_sessions_that_come_back_keep_their_first_answers_kept() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, return_alpha=0.5))
    for i in range(4):  # back 3 s after the first answer: within the 4 s window
        t = 20.0 * i
        ws.started(f"s{i}", "w0", 1000, now=t)
        ws.ended(f"s{i}", 1100, now=t + 1.0)
        ws.started(f"s{i}", "w0", 1200, now=t + 4.0)
        ws.ended(f"s{i}", 1300, now=t + 5.0)
    assert ws.return_rate == 1.0
    ws.started("new", "w0", 1000, now=100.0)
    ws.ended("new", 1100, now=101.0)
    assert ws.tokens("w0", 104.9) == 1100


def test_a_session_back_after_the_window_counts_as_not_returned() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, return_alpha=0.5))
    ws.started("s", "w0", 1000, now=0.0)
    ws.ended("s", 1100, now=1.0)
    ws.started("s", "w0", 1200, now=6.0)  # 5 s later: past the 4 s window
    assert ws.return_rate == pytest.approx(0.5)
    # its own gap is known now: its next answers are kept by that gap, not the return rate
    ws.ended("s", 1300, now=7.0)
    assert ws.keep_s("s") == pytest.approx(10.0)  # factor x its 5 s gap


def test_a_keep_too_short_to_move_the_clock_counts_nothing_and_leaks_nothing() -> None:
    # a return rate near 0 gives a keep that `now + keep` rounds away: the session must not
    # be counted (and never uncounted) on its worker
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0))
    ws.return_rate = 1e-300
    ws.started("s", "w0", 1000, now=100.0)
    ws.ended("s", 1100, now=101.0)
    assert ws.tokens("w0", 101.0) == 0
    assert ws.tokens("w0", 200.0) == 0


def test_many_distinct_sessions_and_tools_stay_under_their_bounds() -> None:
    """Sessions that never come back within `idle_forget_s`, and distinct tool names, are each
    held up to their count bound (least recently active first out); one in flight stays."""
    ws = WorkingSets(RetentionConfig(max_sessions=100, max_tools=10))
    ws.started("long", "w1", 500, 0.0)  # in flight throughout
    for i in range(2_000):
        t = 1.0 + i * 0.01
        ws.started(f"s{i}", "w1", 100, t)
        ws.ended(f"s{i}", 120, t, tool=f"tool-{i}")
        ws.started(f"s{i}", "w1", 120, t + 0.001, after_tool=f"tool-{i}")
        ws.ended(f"s{i}", 140, t + 0.002, tool=f"tool-{i}")
        assert len(ws) <= 101
        assert len(ws._tools) <= 10
    assert ws.home("long", 30.0) == ("w1", 500)  # in flight: counted, never forgotten
    assert "s1999" in ws._sessions and "s0" not in ws._sessions


def test_largest_lists_the_sessions_holding_the_most_kv_now_largest_first() -> None:
    ws = WorkingSets(RetentionConfig(prior_gap_s=2.0, factor=2.0, max_gap_s=60.0))
    ws.started("small", "w0", 100, now=0.0)
    ws.started("big", "w1", 5000, now=0.0)
    ws.started("mid", "w0", 800, now=0.0)
    ws.ended("mid", 900, now=1.0)  # kept through its gap: still counted
    assert ws.largest(2, 1.0) == [("big", "w1", 5000), ("mid", "w0", 900)]
    ws.ended("big", 5000, now=1.0)
    # past their keep the idle sessions are counted nowhere; the one in flight still is
    assert ws.largest(10, 10.0) == [("small", "w0", 100)]
