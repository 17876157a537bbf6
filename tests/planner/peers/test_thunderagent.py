"""ThunderAgent's program scheduler: pause at 0.95 of a worker's pool down to 0.80, ACTING
programs smallest first and REASONING ones only at their tool boundary; resume under 0.85
(0.10 hysteresis), waiting programs first, then new ones, then idle ones, smallest first."""

from __future__ import annotations

import pytest

from ownerserve.types import Role
from planner.policies.peers.thunderagent import (
    ProgramScheduler,
    Status,
    ThunderAgentConfig,
    ThunderAgentPolicy,
)
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

CAP = 1000
NO_BUFFER = ThunderAgentConfig(buffer_tokens=0)


def _scheduler() -> ProgramScheduler:
    return ProgramScheduler({"w": CAP}, NO_BUFFER)


def _turn(s: ProgramScheduler, pid: str, tokens: int, now: float = 0.0) -> None:
    """One request of `pid` of `tokens`, run to its tool boundary (ACTING)."""
    assert s.arrive(pid, tokens, now)
    s.started(pid, "w", tokens)
    s.ended(pid, tokens, now, last=False)


def test_defaults_are_the_published_control_loop() -> None:
    cfg = ThunderAgentConfig()
    assert (cfg.pause_threshold, cfg.pause_target, cfg.resume_hysteresis) == (0.95, 0.80, 0.10)
    assert cfg.resume_limit == pytest.approx(0.85)
    assert (cfg.interval_s, cfg.resume_timeout_s, cfg.buffer_tokens) == (5.0, 1800.0, 256)


@pytest.mark.parametrize(("tokens", "paused"), [(949, False), (950, True)])
def test_a_worker_pauses_its_programs_from_exactly_the_threshold(tokens: int, paused: bool) -> None:
    s = _scheduler()
    _turn(s, "a", tokens)
    s.tick(5.0)
    assert s.is_paused("a") is paused


def test_pausing_takes_acting_programs_smallest_first_down_to_the_target() -> None:
    s = _scheduler()
    for pid, tokens in (("big", 400), ("mid", 350), ("small", 250)):
        _turn(s, pid, tokens)
    s.tick(5.0)  # 1000 >= 950: pause from the smallest until <= 800
    assert s.paused() == ["small"]
    assert s.used["w"] == 750


def test_a_reasoning_program_is_paused_only_at_its_tool_boundary() -> None:
    s = _scheduler()
    assert s.arrive("r", 960, 0.0)
    s.started("r", "w", 960)
    s.tick(5.0)
    assert not s.is_paused("r") and s.status("r") is Status.REASONING  # its request runs on
    s.ended("r", 980, 6.0, last=False)
    assert s.is_paused("r")
    assert not s.arrive("r", 990, 7.0)  # its next request waits for a resume


def test_resume_releases_waiting_programs_then_new_ones_smallest_first_under_the_limit() -> None:
    s = _scheduler()
    for pid, tokens in (("a", 300), ("b", 100), ("c", 10), ("filler", 590)):
        _turn(s, pid, tokens)
    s.tick(5.0)  # 1000: c, b, then a paused (590 <= 800)
    assert s.paused() == ["c", "b", "a"]
    assert not s.arrive("a", 300, 6.0) and not s.arrive("b", 100, 6.0)
    assert not s.arrive("new", 50, 6.0)  # programs are paused: a new one waits too
    s.tick(10.0)  # room under 0.85: 850 - 590 = 260 -> b (100), new (50), idle c (10); a waits
    assert [s.next_release(), s.next_release(), s.next_release()] == ["b", "new", None]
    assert s.is_paused("a") and not s.is_paused("c")
    assert s.used["w"] == 590 + 100 + 50 + 10
    s.ended("filler", 590, 11.0, last=True)  # the filler program is done: 590 tokens free
    s.tick(15.0)
    assert s.next_release() == "a"


@pytest.mark.parametrize(("tokens", "resumed"), [(50, True), (51, False)])
def test_a_resume_fills_a_worker_up_to_the_hysteresis_limit_only(
    tokens: int, resumed: bool
) -> None:
    s = _scheduler()
    for pid, size in (("held", 800), ("x", tokens), ("z", 100)):
        _turn(s, pid, size)
    s.tick(5.0)  # >= 950: x, then z paused (800 <= 800)
    assert s.paused() == ["x", "z"]
    assert not s.arrive("x", tokens, 6.0)
    s.tick(10.0)  # room under 0.85 of the pool: 850 - 800 = 50
    assert (s.next_release() == "x") is resumed
    assert s.is_paused("z")  # idle, 100 tokens: no room


def test_a_program_too_big_to_resume_is_forced_after_the_timeout() -> None:
    s = _scheduler()
    _turn(s, "huge", 960)
    s.tick(5.0)
    assert not s.arrive("huge", 960, 6.0)
    s.tick(1000.0)  # 960 > 850 fits nowhere
    assert s.next_release() is None
    s.tick(1805.0)  # waited 1,800 s since it was paused
    assert s.next_release() == "huge"


def test_a_new_program_goes_at_once_only_where_it_fits() -> None:
    s = ProgramScheduler({"w1": CAP, "w2": CAP}, ThunderAgentConfig())
    assert s.arrive("a", CAP - 256, 0.0)  # fits a worker with its decode buffer
    s.started("a", "w1", CAP - 256)
    assert not s.arrive("b", CAP, 0.0)  # its prompt and buffer fit no worker's pool


def test_routing_is_dynamo_kv_routing() -> None:
    policy = ThunderAgentPolicy(UNIT_CONFIG, unit_model())
    cl = cluster(worker("h0", Role.HYBRID), worker("h1", Role.HYBRID, gpu=4))
    plan = policy.plan(request(500, chain=(1, 2, 3, 4, 5)), cl)
    assert plan.policy == "thunderagent"
    assert plan.chosen.decode_worker == "h1"  # the prefix holder: the least KV cost
