"""The simulator's copy of the router's admission queue: watermarks with hysteresis, least
attained service first with an aging bound, a bounded queue and wait."""

from __future__ import annotations

from loadgen.sim.admission import AdmissionConfig, RouterAdmission, ThunderAgentGate
from planner.policies.peers.thunderagent import ProgramScheduler, ThunderAgentConfig


def _admission(usage: dict[str, float], config: AdmissionConfig | None = None) -> RouterAdmission:
    return RouterAdmission(list(usage), usage.__getitem__, config)


def test_requests_go_at_once_until_every_worker_reaches_the_high_watermark() -> None:
    usage = {"a": 0.94, "b": 0.5}
    adm = _admission(usage)
    assert adm.arrive(1, 100, 0, 0.0)
    usage["b"] = 0.95
    adm.started(1, "b", 100, 0.0)
    adm.started(1, "a", 100, 0.0)  # a at 0.94: still open
    assert adm.arrive(2, 100, 0, 0.0)
    usage["a"] = 0.95
    adm.started(2, "a", 100, 0.0)
    assert not adm.arrive(3, 100, 0, 0.0)
    assert adm.next_release(0.0) is None


def test_a_paused_worker_opens_again_only_below_the_low_watermark() -> None:
    usage = {"a": 0.96}
    adm = _admission(usage)
    adm.started(0, "a", 0, 0.0)
    assert not adm.arrive(1, 100, 0, 0.0)
    usage["a"] = 0.80
    adm.ended(0, "a", 0, 1.0, False)
    assert adm.next_release(1.0) is None  # 0.80 is not below the low watermark
    usage["a"] = 0.79
    adm.ended(0, "a", 0, 2.0, False)
    assert adm.next_release(2.0) == 1
    assert adm.waits_s == [2.0]


def test_the_least_served_session_goes_first_but_the_aged_go_before_it() -> None:
    usage = {"a": 1.0}
    adm = _admission(usage)
    adm.started(0, "a", 0, 0.0)
    assert not adm.arrive("old", 10, 5_000, 0.0)
    assert not adm.arrive("rich", 10, 9_000, 5.0)
    assert not adm.arrive("poor", 10, 100, 6.0)
    usage["a"] = 0.0
    adm.ended(0, "a", 0, 8.0, False)
    # at 8 s none has waited 10 s: least attained service first
    assert [adm.next_release(8.0), adm.next_release(8.0)] == ["poor", "old"]
    assert adm.next_release(8.0) == "rich"


def test_an_aged_request_goes_before_less_served_ones() -> None:
    usage = {"a": 1.0}
    adm = _admission(usage)
    adm.started(0, "a", 0, 0.0)
    assert not adm.arrive("old", 10, 5_000, 0.0)
    assert not adm.arrive("poor", 10, 100, 6.0)
    usage["a"] = 0.0
    adm.ended(0, "a", 0, 10.0, False)
    assert [adm.next_release(10.0), adm.next_release(10.0)] == ["old", "poor"]


def test_past_its_bounds_the_queue_refuses_requests() -> None:
    usage = {"a": 1.0}
    adm = _admission(usage, AdmissionConfig(max_queued=2, max_queue_wait_s=60.0))
    adm.started(0, "a", 0, 0.0)
    assert not adm.arrive(1, 10, 0, 0.0)
    assert not adm.arrive(2, 10, 0, 30.0)
    assert not adm.arrive(3, 10, 0, 30.0)  # full
    assert adm.rejected(30.0) == [3] and adm.rejected_full == 1
    assert adm.rejected(61.0) == [1] and adm.rejected_timeout == 1  # waited over 60 s
    usage["a"] = 0.0
    adm.ended(0, "a", 0, 62.0, False)
    assert adm.next_release(62.0) == 2
    assert adm.queued == 2


class _Programs:
    """Working-set shares and homes the program-level admission reads, set by the test."""

    def __init__(self) -> None:
        self.share: dict[str, float] = {}
        self.homes: dict[object, str] = {}
        self.released: list[object] = []

    def programs(self, worker: str, now: float) -> float:
        return self.share.get(worker, 0.0)

    def home(self, session: object, now: float) -> str | None:
        return self.homes.get(session)

    def release(self, session: object, now: float) -> None:
        self.released.append(session)
        self.homes.pop(session, None)


def _programs_admission(p: _Programs, workers: tuple[str, ...] = ("a",)) -> RouterAdmission:
    return RouterAdmission(
        list(workers),
        lambda w: 0.0,
        AdmissionConfig(pause_watermark=0.95),
        programs=p.programs,
        home=p.home,
        release=p.release,
    )


def test_new_sessions_wait_while_the_programs_fill_every_worker_then_go_first_come() -> None:
    p = _Programs()
    adm = _programs_admission(p)
    assert adm.tick_s > 0  # idle sessions leave the working sets with time: it rechecks
    assert adm.arrive("s1", 10, 0, 0.0)
    p.share["a"] = 0.96
    assert not adm.arrive("s2", 10, 0, 1.0) and not adm.arrive("s3", 10, 0, 2.0)
    p.share["a"] = 0.85
    assert adm.next_release(3.0) is None  # closed until below the low watermark
    p.share["a"] = 0.5
    assert [adm.next_release(4.0), adm.next_release(4.0)] == ["s2", "s3"]


def test_a_session_on_a_full_worker_is_paused_at_its_tool_boundary_and_resumes_first() -> None:
    p = _Programs()
    adm = _programs_admission(p, ("a", "b"))
    p.homes["run"] = "b"
    p.homes["big"] = "a"
    p.share.update(a=0.97, b=0.5)
    assert adm.arrive("big", 10, 800, 0.0)  # b has room: the cluster is not full, no pause
    assert not adm.closed_to_programs("a", 0.0)
    p.share["b"] = 0.94  # the programs fill the cluster (mean 0.955)
    assert adm.arrive("run", 10, 500, 0.1)  # its worker is open: it runs on
    assert adm.closed_to_programs("a", 0.1) and not adm.closed_to_programs("b", 0.1)
    assert not adm.arrive("big", 10, 800, 0.1)  # paused: its KV is released
    assert p.released == ["big"] and adm.programs_paused == 1
    assert not adm.arrive("new", 10, 0, 0.1)  # a new session waits behind the paused one
    assert adm.next_release(0.2) == "big"  # b is open to programs: the paused one first
    assert adm.next_release(0.2) == "new"


def test_only_new_sessions_are_refused_and_a_paused_one_resumes_after_the_wait_bound() -> None:
    p = _Programs()
    adm = RouterAdmission(
        ["a"],
        lambda w: 0.0,
        AdmissionConfig(max_queued=1, max_queue_wait_s=60.0, pause_watermark=1.5),
        programs=p.programs,
        home=p.home,
        release=p.release,
    )
    p.share["a"] = 2.0  # past the knee (pause watermark 1.5)
    assert not adm.arrive("n1", 10, 0, 0.0)
    assert not adm.arrive("n2", 10, 0, 0.0)  # one new session waits already: refused
    assert not adm.arrive("old", 10, 900, 0.0)  # a started session waits, whatever the count
    assert adm.rejected(0.0) == ["n2"]
    assert adm.next_release(59.0) is None
    assert adm.rejected(61.0) == ["n1"]  # the new one waited too long
    assert adm.next_release(61.0) == "old"  # the started one goes once it waited that long


def test_below_the_knee_a_started_session_ages_into_a_full_worker_a_new_one_does_not() -> None:
    p = _Programs()
    adm = RouterAdmission(
        ["a"],
        lambda w: 0.0,
        AdmissionConfig(pause_watermark=1.5),
        programs=p.programs,
        home=p.home,
    )
    p.share["a"] = 1.0  # the worker is full of programs, the cluster under the pause watermark
    assert not adm.arrive("new", 10, 0, 0.0)
    assert not adm.arrive("back", 10, 500, 0.0)  # started, its KV released
    assert adm.next_release(9.0) is None
    assert adm.next_release(10.0) == "back"  # queued aging_s: KV headroom is enough
    assert adm.next_release(50.0) is None  # a new session waits for room ...
    assert adm.rejected(61.0) == ["new"]  # ... or its 429


def test_a_worker_that_one_session_fills_stays_open_to_programs() -> None:
    p = _Programs()
    count = {"a": 1}
    adm = RouterAdmission(
        ["a"],
        lambda w: 0.0,
        AdmissionConfig(pause_watermark=0.95),
        programs=p.programs,
        sessions=lambda w, now: count[w],
        home=p.home,
    )
    p.share["a"] = 1.2  # one session's KV is more than the worker holds
    assert adm.arrive("new", 10, 0, 0.0)
    count["a"] = 2  # two sessions fill it: closed
    assert not adm.arrive("new2", 10, 0, 1.0)
    assert adm.closed_to_programs("a", 1.0)


def test_a_subagent_of_a_program_under_way_waits_as_a_started_session() -> None:
    p = _Programs()
    adm = RouterAdmission(
        ["a"], lambda w: 0.0, AdmissionConfig(pause_watermark=1.5), programs=p.programs
    )
    p.share["a"] = 1.0  # full of programs, the cluster under the pause watermark
    assert not adm.arrive("back", 10, 500, 0.0)
    adm.spawned("sub", "back")
    assert not adm.arrive("sub", 10, 0, 1.0)
    assert not adm.arrive("new", 10, 0, 1.0)
    assert adm.next_release(10.5) == "back"  # aged first, oldest first
    assert adm.next_release(11.0) == "sub"  # a program's part ages in like a started session
    assert adm.next_release(50.0) is None
    assert adm.rejected(61.5) == ["new"]  # only the new session is refused


def test_a_subagent_starts_at_once_on_its_spawners_counted_kv() -> None:
    p = _Programs()
    adm = _programs_admission(p)
    p.share["a"] = 0.96  # closed to new programs
    p.homes["parent"] = "a"
    assert not adm.arrive("new", 10, 0, 0.0)
    adm.spawned("sub", "parent")
    assert adm.arrive("sub", 10, 0, 0.0)  # resident on its spawner's KV
    adm.spawned("sub2", "gone")
    assert not adm.arrive("sub2", 10, 0, 0.0)  # its spawner's KV released


def test_thunderagent_with_one_program_id_per_agent_tree_runs_subagents_in_it() -> None:
    cfg = ThunderAgentConfig(buffer_tokens=0)
    for tree in (False, True):
        gate = ThunderAgentGate(ProgramScheduler({"w": 100}, cfg), tree=tree)
        assert gate.arrive("p", 90, 0, 0.0)
        gate.started("p", "w", 90, 0.0)
        gate.spawned("s", "p")
        # its own program finds no room; inside its parent's active program it runs at once
        assert gate.arrive("s", 50, 0, 0.0) is tree
        if not tree:
            continue
        gate.started("s", "w", 50, 0.0)
        gate.ended("p", "w", 95, 1.0, last=True)  # the parent is done, its subagent is not
        assert gate.scheduler.status("p") is not None
        gate.ended("s", "w", 60, 2.0, last=True)
        assert gate.scheduler.status("p") is None
