"""The simulator's copy of the router's admission queue: watermarks with hysteresis, least
attained service first with an aging bound, a bounded queue and wait."""

from __future__ import annotations

from loadgen.sim.admission import AdmissionConfig, RouterAdmission


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
