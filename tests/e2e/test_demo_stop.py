"""How `ownerserve demo` stops: SIGTERM drains it as it drains `ownerserve serve` (a stream in
flight ends whole, with `[DONE]`, and the demo exits 0), and its emulated workers die with it
even when it is SIGKILLed and runs nothing more."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import orjson
import pytest

from ownerserve.cli.demo import ROLES
from tests.waiting import until_sync

REPO = Path(__file__).resolve().parents[2]
SERVING = "Serving the OpenAI API at "
STREAMED_TOKENS = 300
"""Long enough to be streaming when the signal lands (about 1 s of emulated decode at --speed 2),
short enough to end well inside the drain's grace (`router.server.SHUTDOWN_GRACE_S`)."""


class _Demo:
    """`ownerserve demo --port 0` (serving until stopped) as a child process of the test."""

    def __init__(self, log: IO[str], speed: float) -> None:
        cmd = [sys.executable, "-m", "ownerserve", "demo", "--port", "0", "--speed", str(speed),
               "--steps", "1", "--no-compare"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        self.log = log

    def wait_serving(self) -> str:
        """The demo's base URL (`http://host:port`), once it says it serves."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends at EOF if the demo exits
            if SERVING in line:
                url = line.split(SERVING, 1)[1].split()[0]
                return url.removesuffix("/v1")
        self.log.seek(0)
        pytest.fail(f"demo exited {self.proc.wait()} before serving:\n{self.log.read()[-3000:]}")

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]


@contextlib.contextmanager
def _demo(tmp_path: Path, speed: float) -> Iterator[_Demo]:
    with (tmp_path / "demo.log").open("w+") as log:
        demo = _Demo(log, speed)
        try:
            yield demo
        finally:
            if demo.proc.poll() is None:  # a failed test: leave nothing behind
                os.killpg(demo.proc.pid, signal.SIGKILL)
                demo.proc.wait()


def _emulator_children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes that are emulated workers."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            args = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # it exited meanwhile
        if ppid == pid and "workers.emulator" in args:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except OSError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_lets_a_stream_in_flight_end_with_done_and_exits_zero(tmp_path: Path) -> None:
    with _demo(tmp_path, speed=2.0) as demo:
        url = demo.wait_serving()
        body = {
            "model": "ownerserve-tiny",
            "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": STREAMED_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        data: list[str] = []
        with (
            httpx.Client(base_url=url, timeout=30.0) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status_code == 200, resp.read()
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    data.append(line[6:])
                    break
            demo.proc.send_signal(signal.SIGTERM)  # mid-stream: the first chunk is in
            # it stops accepting at once, while the stream goes on
            until_sync(lambda: _refuses_connections(url), what="the demo's listener closed")
            data += [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        chunks: list[dict[str, Any]] = [orjson.loads(d) for d in data[:-1]]
        assert not [c for c in chunks if "error" in c]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == STREAMED_TOKENS
        assert demo.proc.wait(timeout=30) == 0, demo.log_tail()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigkilled_demo_leaves_no_worker_running(tmp_path: Path) -> None:
    with _demo(tmp_path, speed=8.0) as demo:
        demo.wait_serving()
        workers = _emulator_children(demo.proc.pid)
        assert len(workers) == len(ROLES)
        try:
            demo.proc.kill()  # SIGKILL: the demo runs nothing more, no cleanup of its own
            demo.proc.wait()
            until_sync(
                lambda: not [pid for pid in workers if _running(pid)],
                what="the SIGKILLed demo's workers exited",
            )
        finally:
            for pid in workers:  # a failed test: leave nothing behind
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
