"""The replay client against a real local HTTP server: timings, sessions, bounds and errors."""

from __future__ import annotations

import asyncio
import io
import itertools
import time
from dataclasses import replace

from loadgen.client import RunOptions, run_workload
from loadgen.progress import ProgressBar
from loadgen.workloads import Msg, Session, Step, Workload
from tests.loadgen.openai_stub import create_stub_app, serve_stub


def _session(
    sid: str, start: float, contents: list[str], gap: float = 0.0, out: int = 5
) -> Session:
    steps = tuple(
        Step((Msg("user", c),), out, gap if k else 0.0, "r" * out, "turn")
        for k, c in enumerate(contents)
    )
    return Session(sid, start, steps, "test", "g")


async def test_sessions_record_ttft_itl_and_e2e_including_tool_gaps() -> None:
    app = create_stub_app(token_delay_s=0.002)
    w = Workload("t", 0, (_session("a", 0.0, ["hello", "tool out", "more"], gap=0.1),))
    async with serve_stub(app) as url:
        res = await run_workload(w, RunOptions(target=url, progress=False))
    assert [r.step for r in res.requests] == [0, 1, 2]
    for r in res.requests:
        assert r.ok and r.status == 200
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 4 and r.completion_tokens == 5
        assert r.tpot_s is not None and r.tpot_s > 0
    (s,) = res.sessions
    assert s.completed and s.steps_done == 3 and s.idle_s == 0.2
    assert s.e2e_s is not None and s.e2e_s >= 0.2 + sum(r.e2e_s for r in res.requests) * 0.99
    # the conversation grows with the scripted replies; the session header is sent
    msgs = app.state.bodies[2]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert app.state.bodies[0]["stream"] is True and app.state.bodies[0]["ignore_eos"] is True
    assert app.state.headers[0]["x-session-id"] == "a"
    assert res.requests[0].prompt_tokens == len("hello")


async def test_open_loop_start_times_are_honoured() -> None:
    w = Workload("t", 0, (_session("a", 0.0, ["x"]), _session("b", 0.3, ["y"])))
    async with serve_stub(create_stub_app()) as url:
        res = await run_workload(w, RunOptions(target=url, progress=False))
    a, b = res.requests
    assert b.sent_s - a.sent_s >= 0.29


async def test_a_subagent_starts_when_its_parent_sends_the_step_that_spawns_it() -> None:
    parent = _session("p", 0.0, ["a", "b", "c"], gap=0.2)
    # planned for 0.01 s: its parent's step 1 comes only after that step's 0.2 s tool gap
    sub = replace(_session("p-sub0", 0.01, ["task"]), spawned_at=("p", 1))
    orphan = replace(_session("q-sub0", 0.0, ["task"]), spawned_at=("q", 5))
    short = _session("q", 0.0, ["only"])  # ends before its step 5: its subagent starts then
    w = Workload("t", 0, (parent, sub, short, orphan))
    app = create_stub_app()
    async with serve_stub(app) as url:
        res = await run_workload(w, RunOptions(target=url, progress=False))
    # a subagent names its spawner (`x-parent-session-id`, as OpenCode's do); others do not
    parents = {h["x-session-id"]: h.get("x-parent-session-id") for h in app.state.headers}
    assert parents == {"p": None, "p-sub0": "p", "q": None, "q-sub0": "q"}
    sent = {(r.session_id, r.step): r.sent_s for r in res.requests}
    assert sent[("p-sub0", 0)] >= sent[("p", 1)] - 0.005 and sent[("p-sub0", 0)] >= 0.19
    assert sent[("q-sub0", 0)] >= sent[("q", 0)]
    assert all(s.completed for s in res.sessions)


async def test_errors_are_counted_and_stop_their_session_only() -> None:
    w = Workload(
        "t",
        0,
        (
            _session("http", 0.0, ["FAIL500", "never sent"]),
            _session("stream", 0.0, ["FAILSTREAM"]),
            _session("good", 0.0, ["fine", "fine too"]),
        ),
    )
    async with serve_stub(create_stub_app()) as url:
        res = await run_workload(w, RunOptions(target=url, progress=False))
    by = {r.session_id: r for r in res.requests if r.step == 0}
    assert by["http"].status == 500 and by["http"].error is not None
    assert by["http"].error.startswith("HTTP 500")
    assert by["stream"].error is not None and "worker died" in by["stream"].error
    assert by["good"].ok
    sessions = {s.session_id: s for s in res.sessions}
    assert not sessions["http"].completed and sessions["http"].steps_done == 0
    assert sessions["good"].completed
    assert len(res.requests) == 4  # the failed session's second step is not sent


async def test_connection_refused_is_an_error_not_an_exception() -> None:
    w = Workload("t", 0, (_session("a", 0.0, ["x"]),))
    res = await run_workload(w, RunOptions(target="http://127.0.0.1:9", progress=False))
    (r,) = res.requests
    assert r.status == 0 and r.error is not None and "Connect" in r.error


async def test_total_time_bound_cuts_inflight_and_unstarted_work_and_records_it() -> None:
    w = Workload(
        "t",
        0,
        (_session("slow", 0.0, ["SLOW"]), _session("late", 10.0, ["x"])),
    )
    async with serve_stub(create_stub_app()) as url:
        t0 = time.monotonic()
        res = await run_workload(w, RunOptions(target=url, duration_s=0.5, progress=False))
        assert time.monotonic() - t0 < 3.0
    assert res.time_limited
    (r,) = res.requests
    assert r.error is not None and "time limit" in r.error
    sessions = {s.session_id: s for s in res.sessions}
    assert sessions["late"].started_s is None and sessions["late"].error is not None
    assert sessions["slow"].error is not None


async def test_inflight_bound_serializes_requests() -> None:
    w = Workload("t", 0, tuple(_session(f"s{i}", 0.0, ["x"], out=20) for i in range(4)))
    app = create_stub_app(token_delay_s=0.005)
    async with serve_stub(app) as url:
        res = await run_workload(w, RunOptions(target=url, max_inflight=1, progress=False))
    spans = sorted((r.sent_s, r.sent_s + r.e2e_s) for r in res.requests)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 0.005


def test_progress_bar_draws_counts_and_errors() -> None:
    buf = io.StringIO()
    bar = ProgressBar(4, "run", stream=buf, enabled=True, interval_s=0.0)
    bar.update()
    bar.update(errors=1)
    bar.close()
    last = buf.getvalue().split("\r")[-1]
    assert "2/4 req" in last and "err 1" in last and last.startswith("run [")
    assert ProgressBar(3, stream=io.StringIO()).enabled is False  # not a TTY


def test_run_in_fresh_event_loop_is_reentrant() -> None:
    # the CLI calls asyncio.run(); two runs in a row must not share state
    async def once() -> int:
        async with serve_stub(create_stub_app()) as url:
            res = await run_workload(
                Workload("t", 0, (_session("a", 0.0, ["x"]),)),
                RunOptions(target=url, progress=False),
            )
        return len(res.requests)

    assert asyncio.run(once()) == 1
    assert asyncio.run(once()) == 1
