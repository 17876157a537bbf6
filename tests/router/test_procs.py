"""`router.procs`: the `--processes` count, the refusal of N in-process directories, and the
supervisor over real forked processes (restarts, giving up on a process that never listens,
SIGTERM forwarded)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest

from ownerserve.config import settings_from_dict
from ownerserve.errors import ConfigError
from router.procs import (
    MAX_START_FAILURES,
    Supervisor,
    check_shareable,
    parse_processes,
    usable_cores,
)
from tests.waiting import until_sync

pytestmark = pytest.mark.timeout(60)


def test_processes_auto_is_the_usable_cores():
    assert parse_processes("auto") == usable_cores() == len(os.sched_getaffinity(0))
    assert parse_processes("3") == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(ConfigError, match="--processes"):
            parse_processes(bad)


def test_several_processes_need_the_redis_directory():
    memory = settings_from_dict(
        {"models": [{"name": "m"}], "workers": [{"id": "w0", "url": "http://127.0.0.1:9"}]}
    )
    check_shareable(memory, 1)
    with pytest.raises(ConfigError, match=r"directory\.backend: redis"):
        check_shareable(memory, 2)
    redis = settings_from_dict(
        {
            "models": [{"name": "m"}],
            "workers": [{"id": "w0", "url": "http://127.0.0.1:9"}],
            "directory": {"backend": "redis", "redis_url": "redis://127.0.0.1:1"},
        }
    )
    check_shareable(redis, 2)


def test_a_process_that_never_listens_stops_the_supervisor_non_zero():
    def child(slot: int, ready: Callable[[], None]) -> int:
        return 3  # fails before `ready`

    sup = Supervisor(2, child, backoff_s=0.001)
    assert sup.run() == 1
    # the failing slot was started MAX_START_FAILURES times before the supervisor gave up
    assert max(sup.starts.values()) == MAX_START_FAILURES
    assert sup.children == {}


def test_a_process_that_dies_after_listening_is_restarted_and_sigterm_stops_all(
    tmp_path,
):
    marks = tmp_path / "marks"
    marks.mkdir()

    def child(slot: int, ready: Callable[[], None]) -> int:
        ready()
        n = len(list(marks.iterdir()))
        (marks / f"{slot}-{os.getpid()}").touch()
        if slot == 0 and n < 2:  # the first start of slot 0 dies once it listened
            return 1
        signal.sigwait({signal.SIGTERM})
        (marks / f"stopped-{os.getpid()}").touch()
        return 0

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    sup = Supervisor(2, child, backoff_s=0.001)
    result: list[int] = []
    try:
        runner = threading.Thread(target=lambda: result.append(_run_off_main(sup)))
        runner.start()

        def restarted() -> bool:
            return (
                sup.restarts >= 1
                and len(sup.children) == 2
                and all(c.listening for c in sup.children.values())
            )

        until_sync(restarted, what="slot 0 restarted and both listening")
        sup.stopping = True  # what SIGTERM's handler does (signals reach the main thread)
        runner.join(timeout=30)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    assert result == [0]
    assert len([m for m in marks.iterdir() if m.name.startswith("stopped-")]) == 2


def _run_off_main(sup: Supervisor) -> int:
    """`Supervisor.run` off the main thread: signal handlers can only be installed on the
    main thread, so this runs its loop without them (the test sets `stopping` itself)."""
    for slot in range(sup.processes):
        sup._spawn(slot)
    try:
        return sup._loop()
    finally:
        sup._stop_all()
