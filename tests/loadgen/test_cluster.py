"""The launcher's children never outlive it: whether the launching process exits normally or is
sent SIGTERM inside `sigterm_as_interrupt`, the processes it started are stopped (an emulated
worker left behind holds its ports)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from loadgen.cluster import REPO_ROOT, ManagedProcess

LAUNCH_A_SLEEPER = """
    import sys, time
    from loadgen.cluster import ManagedProcess, sigterm_as_interrupt
    p = ManagedProcess("sleeper", ["sleep", "60"]).start()
    print(p.pid, flush=True)
"""


def _launcher(body: str) -> tuple[subprocess.Popen[str], int]:
    code = textwrap.dedent(LAUNCH_A_SLEEPER) + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not Path(f"/proc/{pid}").exists()


def test_children_still_running_are_stopped_when_the_launcher_exits() -> None:
    proc, child = _launcher("")  # exits right after starting it, without stop()
    assert proc.wait(timeout=20) == 0
    assert _gone_soon(child)


def test_sigterm_inside_sigterm_as_interrupt_stops_the_children() -> None:
    proc, child = _launcher(
        """
        try:
            with sigterm_as_interrupt():
                print("ready", flush=True)
                time.sleep(60)
        except KeyboardInterrupt:
            sys.exit(3)
        """
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    assert Path(f"/proc/{child}").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 3
    assert _gone_soon(child)


def test_a_temporary_log_is_removed_at_stop_a_given_one_kept(tmp_path: Path) -> None:
    temp = ManagedProcess("echo", ["echo", "hello"]).start()
    kept = ManagedProcess("echo", ["echo", "hello"], tmp_path / "echo.log").start()
    for p in (temp, kept):
        assert p.proc is not None and p.proc.wait(timeout=10) == 0
        assert "hello" in p.log_tail()
    temp_path = temp.log_path
    temp.stop()
    kept.stop()
    assert temp_path is not None and not temp_path.exists()
    assert "hello" in (tmp_path / "echo.log").read_text()
