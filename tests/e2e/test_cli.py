"""The `ownerserve` CLI as a user runs it: the demo end to end (and stopped with SIGTERM, and
restarted at once), config errors, help texts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from ownerserve.cli.demo import ROLES, SCRIPT
from ownerserve.ports import check_bindable, free_port
from planner.types import Action

REPO = Path(__file__).resolve().parents[2]
WORKER_PORT_FLAGS = ("--port", "--bootstrap-port", "--kv-events-port")


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ownerserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


STEP_LINE = re.compile(
    r"^\s*(?P<step>\d+)\s+(?P<session>\S+)\s+(?P<what>.{24})\s(?P<cls>\S+)\s+(?P<action>\S+)\s+"
    r"P=(?P<p>\S+) D=(?P<d>\S+)\s+(?P<ttft>[\d.]+)\s+(?P<e2e>[\d.]+)\s+(?P<prompt>\d+)\s+"
    r"(?P<cached>\d+)\s+(?P<runner_up>\S+)$"
)
ROUTER_ROWS = ("ownerserve", "round-robin", "sticky (session hash)")


@pytest.mark.slow
def test_demo_once_prints_the_script_and_the_routers_side_by_side_and_exits_zero() -> None:
    proc = _cli("demo", "--once", "--port", "0", "--speed", "8", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for ln in proc.stdout.splitlines() if (m := STEP_LINE.match(ln))]
    assert [int(m["step"]) for m in steps] == list(range(1, len(SCRIPT) + 1)), proc.stdout
    assert [m["session"] for m in steps] == [s.session for s in SCRIPT]
    assert {m["action"] for m in steps} <= {a.value for a in Action}
    cached = [int(m["cached"]) for m in steps]
    # the first request is cold; every later turn of a session reuses its own prefix, and the
    # subagent's first turn its parent's (colocated with it, or fetched)
    assert cached[0] == 0
    for m, step, c in zip(steps, SCRIPT, cached, strict=True):
        if step.role == "tool" or step.fork_of is not None:
            assert c > 0, (m.group(0), proc.stdout)
    rows = {
        name: ln
        for ln in proc.stdout.splitlines()
        for name in ROUTER_ROWS
        if ln.startswith(name + " ") and ln[len(name) :].split()[0].isdigit()
    }
    assert set(rows) == set(ROUTER_ROWS), proc.stdout
    for ln in rows.values():  # computed, cached, reuse held, delivered, KV moved, dup, ...
        assert "%" in ln and "MiB" in ln and ln.rstrip().endswith(tuple("0123456789")), ln


class _Demo:
    """`ownerserve demo` (serving until stopped) as a child process of the test."""

    def __init__(
        self, port: int, log: IO[str], *extra: str, env: dict[str, str] | None = None
    ) -> None:
        cmd = [sys.executable, "-m", "ownerserve", "demo", "--port", str(port), "--speed", "8",
               "--steps", "1", "--no-compare", *extra]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        self.log = log

    def wait_serving(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends at EOF if the demo exits
            if "Serving the OpenAI API at" in line:
                return
        self.log.seek(0)
        pytest.fail(f"demo exited {self.proc.wait()} before serving:\n{self.log.read()[-3000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@contextlib.contextmanager
def _demo(
    port: int, tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[_Demo]:
    with (tmp_path / f"demo-{port}-{time.monotonic_ns()}.log").open("w+") as log:
        demo = _Demo(port, log, *extra, env=env)
        try:
            yield demo
        finally:
            if demo.proc.poll() is None:  # a failed test: leave nothing behind
                demo.proc.send_signal(signal.SIGTERM)
                try:
                    demo.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(demo.proc.pid, signal.SIGKILL)
                    demo.proc.wait()


def _emulator_children(pid: int) -> dict[int, list[str]]:
    """The command lines of `pid`'s child processes that are emulated workers, by pid."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            args = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # it exited meanwhile
        if ppid == pid and "workers.emulator" in args:
            out[int(stat.parent.name)] = args
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_stops_its_workers_on_sigterm(tmp_path: Path) -> None:
    with _demo(free_port(), tmp_path) as demo:
        demo.wait_serving()
        workers = _emulator_children(demo.proc.pid)
        ports = [
            int(args[i + 1])
            for args in workers.values()
            for i, a in enumerate(args[:-1])
            if a in WORKER_PORT_FLAGS
        ]
        assert len(workers) == len(ROLES) and len(ports) == 3 * len(ROLES)
        assert demo.stop() == 0
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    for port in ports:
        check_bindable("127.0.0.1", port)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_restarted_at_once_on_the_same_port_binds(tmp_path: Path) -> None:
    """A client still connected when the demo stops leaves the proxy's side of the connection
    in TIME_WAIT on the demo's port (the server closes first); the restart binds all the same."""
    port = free_port()
    with _demo(port, tmp_path) as first, httpx.Client(timeout=10) as client:
        first.wait_serving()
        assert client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
        assert first.stop() == 0
    again = _cli(
        "demo", "--once", "--port", str(port), "--speed", "8", "--steps", "1", "--no-compare",
        timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "cannot bind" not in again.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_demo_serves_the_admin_api_under_the_token_its_flag_gives(tmp_path: Path) -> None:
    # the flag wins over the variable `serve` reads, as `serve`'s own flags do
    port = free_port()
    env = {"OWNERSERVE_SERVER__ADMIN_TOKEN": "from-env"}
    with _demo(port, tmp_path, "--admin-token", "from-flag", env=env) as demo:
        demo.wait_serving()
        shown = _cli(
            "status", "--url", f"http://127.0.0.1:{port}", "--admin-token", "from-flag", "--json"
        )
        refused = _cli("status", "--url", f"http://127.0.0.1:{port}", "--admin-token", "from-env")
        assert demo.stop() == 0
    assert shown.returncode == 0, shown.stderr
    assert sorted(w["id"] for w in json.loads(shown.stdout)["workers"]) == sorted(
        wid for wid, _ in ROLES
    )
    assert refused.returncode == 2 and "token" in refused.stderr.lower(), refused.stderr


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


@pytest.mark.parametrize(
    "command", ["serve", "status", "demo", "worker", "loadgen", "bench", "sim"]
)
def test_every_command_has_help(command: str) -> None:
    proc = _cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: ownerserve" in proc.stdout


def test_version() -> None:
    proc = _cli("version")
    assert proc.returncode == 0 and proc.stdout.startswith("ownerserve ")


def test_the_demo_settings_take_the_flags_over_the_environment() -> None:
    from ownerserve.cli.demo import demo_settings, demo_workers

    workers = demo_workers("h100-llama3-8b", 1.0)
    env = {
        "OWNERSERVE_TELEMETRY__OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OWNERSERVE_SERVER__ADMIN_TOKEN": "env-token",
        "OWNERSERVE_SERVER__PORT": "1",
        "OWNERSERVE_ADMISSION__MAX_QUEUED": "7",
    }
    flagged = demo_settings(
        workers, "127.0.0.1", 8123, "ownerserve", admin_token="flag-token",
        otlp_endpoint="http://127.0.0.1:4318", env=env,
    )  # fmt: skip
    assert flagged.server.admin_token == "flag-token" and flagged.server.port == 8123
    assert flagged.telemetry.otlp_endpoint == "http://127.0.0.1:4318"
    assert flagged.admission.max_queued == 7  # what no flag sets comes from the environment
    unflagged = demo_settings(workers, "127.0.0.1", 8123, "ownerserve", env=env)
    assert unflagged.server.admin_token == "env-token"
    assert unflagged.telemetry.otlp_endpoint == "http://127.0.0.1:1"
    assert demo_settings(workers, "127.0.0.1", 8123, "ownerserve").server.admin_token is None
