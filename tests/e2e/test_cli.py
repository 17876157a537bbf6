"""The `ownerserve` CLI as a user runs it: the demo end to end, config errors, help texts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ownerserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.mark.slow
def test_demo_once_prints_a_report_of_every_turn_and_exits_zero() -> None:
    proc = _cli("demo", "--once", "--port", "0", "--speed", "8", "--turns", "4", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [ln.split()[0] for ln in lines] == ["1", "2", "3", "4"]
    actions = {ln.split()[2] for ln in lines}
    assert actions <= {
        "colocated_prefill",
        "remote_prefill",
        "decode_continuation",
        "artifact_fetch",
        "tail_recompute",
        "state_migration",
    }
    # from turn 2 on the session's prefix is reused (cached tokens > 0)
    # columns: turn class action P= D= ttft e2e prompt cached out runner-up
    assert all(int(ln.split()[8]) > 0 for ln in lines[1:])
    assert int(lines[0].split()[8]) == 0


def test_malformed_config_is_one_line_exit_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "workers:\n  - {id: a, url: 'http://127.0.0.1:1'}\n  - {id: a, url: 'http://127.0.0.1:2'}\n"
    )
    proc = _cli("serve", "--config", str(bad))
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert str(bad) in err and "duplicate worker id 'a'" in err


def test_unknown_key_in_config_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner: {polcy: ownerserve}\n")
    proc = _cli("serve", "--config", str(bad))
    assert proc.returncode == 2
    assert "planner.polcy: unknown key" in proc.stderr


@pytest.mark.parametrize("command", ["serve", "demo", "worker", "loadgen", "bench", "sim"])
def test_every_command_has_help(command: str) -> None:
    proc = _cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: ownerserve" in proc.stdout


def test_version() -> None:
    proc = _cli("version")
    assert proc.returncode == 0 and proc.stdout.startswith("ownerserve ")
