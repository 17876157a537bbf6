"""Emulated workers as real processes, and the router in-process in front of them, for the
router's e2e tests (`test_router_*.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ownerserve.config import Settings, settings_from_dict
from planner.explain import parse_plan_header
from router.app import create_app
from router.server import running_app
from tests.conftest import free_port

MODEL = "ownerserve-tiny"
DATA = Path(__file__).resolve().parent / "data"
FAST_DECODE_PROFILE = str(DATA / "router-fast-decode.yaml")
REPO = Path(__file__).resolve().parents[2]


def wait_healthy(proc: subprocess.Popen[bytes], url: str, name: str, timeout_s: float) -> None:
    """Poll `url`/health until 200; raise with the process's stderr tail if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{name} exited: {err[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{name} not healthy in {timeout_s}s")


def kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the process group `proc` leads (started with `start_new_session=True`)."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group, SIGKILL it if it is still there after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        kill_group(proc)


@dataclass
class EmulatedWorker:
    """One `python -m workers.emulator` process."""

    worker_id: str
    role: str
    kind: str = "emulator"
    profile: str = "h100-llama3-8b"
    speed: float = 20.0
    extra: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    bootstrap_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EmulatedWorker:
        cmd = [
            sys.executable, "-m", "workers.emulator",
            "--role", self.role, "--port", str(self.port), "--profile", self.profile,
            "--speed", str(self.speed), "--model", MODEL, "--worker-id", self.worker_id,
            "--bootstrap-port", str(self.bootstrap_port),
            "--kv-events-port", str(self.events_port), *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        return self

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        assert self.proc is not None
        wait_healthy(self.proc, self.url, f"emulator {self.worker_id}", timeout_s)

    def kill(self) -> None:
        """SIGKILL: the worker dies as a crashed engine would, mid-request."""
        kill_group(self.proc)

    def stop(self) -> None:
        stop_group(self.proc)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5.0).text

    def worker_settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.worker_id,
            "url": self.url,
            "role": self.role,
            "kind": self.kind,
            "models": [MODEL],
            "bootstrap_port": self.bootstrap_port,
            "kv_events_endpoint": f"tcp://127.0.0.1:{self.events_port}",
        }
        if self.profile != "h100-llama3-8b":
            out["profile"] = self.profile
        return out


@contextlib.contextmanager
def emulated_workers(*workers: EmulatedWorker) -> Iterator[tuple[EmulatedWorker, ...]]:
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_healthy()
        yield workers
    finally:
        for w in workers:
            w.stop()


def router_settings(
    workers: tuple[EmulatedWorker, ...] | list[EmulatedWorker], **sections: dict[str, Any]
) -> Settings:
    data: dict[str, Any] = {
        "server": {"port": 0, "health_interval_s": 0.5, **sections.get("server", {})},
        "planner": {"policy": "ownerserve", **sections.get("planner", {})},
        "models": [{"name": MODEL}],
        "workers": [w.worker_settings() for w in workers],
    }
    if "directory" in sections:
        data["directory"] = sections["directory"]
    if "telemetry" in sections:
        data["telemetry"] = sections["telemetry"]
    return settings_from_dict(data)


@contextlib.asynccontextmanager
async def proxy(settings: Settings, **app_kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
    """The router app in this event loop: yields (base URL, `Router`)."""
    app = create_app(settings, **app_kwargs)
    async with running_app(app, "127.0.0.1", 0) as url:
        yield url, app.state.router


plan_fields = parse_plan_header  # the e2e tests' name for it


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@contextlib.asynccontextmanager
async def proxy_client(
    settings: Settings, **app_kwargs: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """`proxy` plus an HTTP client on it: yields (client, `Router`)."""
    async with (
        proxy(settings, **app_kwargs) as (url, router),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        yield client, router
