"""Local processes for benchmarks: an emulated xPyD cluster and the routers put in front of it.

Everything runs as real processes on loopback ports: emulated engines (`python -m
workers.emulator`), the OwnerServe proxy (`python -m ownerserve serve --config FILE`) with one
policy, or a peer router (vllm-router, sglang-router) from its own venv. Each process writes its
output to a log file; `stop()` ends its whole process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ProcessFailedError(RuntimeError):
    """A benchmark process exited or never became healthy; the message carries its log's tail."""


@dataclass
class ManagedProcess:
    """One child process in its own process group, its output in `log_path`."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(self.cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO_ROOT,
            env={**os.environ, **(self.env or {})},
        )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 8.0) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None


def wait_healthy(
    procs: Sequence[tuple[ManagedProcess, str]], timeout_s: float = 90.0, path: str = "/health"
) -> None:
    """Wait until every `(process, base_url)` answers 200 on `path`."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for item in list(pending):
                proc, url = item
                if not proc.alive():
                    raise ProcessFailedError(f"{proc.name} exited:\n{proc.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + path).status_code == 200:
                        pending.remove(item)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p, _ in pending)
                tail = pending[0][0].log_tail()
                raise ProcessFailedError(f"not healthy after {timeout_s:.0f}s: {names}\n{tail}")
            time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """An emulated xPyD cluster: how many workers of each role and their timing."""

    prefill: int = 2
    decode: int = 2
    hybrid: int = 2
    profile: str = "h100-llama3-8b"
    speed: float = 1.0
    model: str = "ownerserve-tiny"
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    role: str
    port: int
    bootstrap_port: int
    events_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class EmulatedCluster:
    """Starts the spec's emulated engines; `restart()` gives cold caches on the same ports."""

    def __init__(self, spec: ClusterSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        roles = (
            [("p", "prefill")] * spec.prefill
            + [("d", "decode")] * spec.decode
            + [("h", "hybrid")] * spec.hybrid
        )
        counts: dict[str, int] = {}
        self.workers: list[WorkerInfo] = []
        for prefix, role in roles:
            i = counts[prefix] = counts.get(prefix, -1) + 1
            self.workers.append(
                WorkerInfo(f"{prefix}{i}", role, free_port(), free_port(), free_port())
            )
        self.procs: list[ManagedProcess] = []
        self.generation = 0

    def _cmd(self, w: WorkerInfo) -> list[str]:
        s = self.spec
        return [
            sys.executable,
            "-m",
            "workers.emulator",
            "--role",
            w.role,
            "--port",
            str(w.port),
            "--profile",
            s.profile,
            "--speed",
            str(s.speed),
            "--model",
            s.model,
            "--worker-id",
            w.worker_id,
            "--bootstrap-port",
            str(w.bootstrap_port),
            "--kv-events-port",
            str(w.events_port),
            *s.extra_args,
        ]

    def start(self) -> EmulatedCluster:
        self.generation += 1
        self.procs = [
            ManagedProcess(
                f"worker {w.worker_id}",
                self._cmd(w),
                self.log_dir / f"worker_{w.worker_id}.log",
            ).start()
            for w in self.workers
        ]
        try:
            wait_healthy(list(zip(self.procs, (w.url for w in self.workers), strict=True)))
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.procs = []

    def restart(self) -> None:
        self.stop()
        self.start()

    def by_role(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role in roles]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


def ownerserve_config(
    cluster: EmulatedCluster,
    port: int,
    policy: str,
    *,
    profile: str | None = None,
    planner: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The proxy's settings (as YAML data) for `cluster` with `policy`; `planner` overrides
    other planner settings (e.g. `lambda_hbm`)."""
    spec = cluster.spec
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "directory": {"backend": "memory"},
        "planner": {**(planner or {}), "policy": policy, "profile": profile or spec.profile},
        "models": [{"name": spec.model, "tokenizer": "byte"}],
        "workers": [
            {
                "id": w.worker_id,
                "url": w.url,
                "role": w.role,
                "kind": "emulator",
                "models": [spec.model],
                "bootstrap_port": w.bootstrap_port,
                "kv_events_endpoint": f"tcp://127.0.0.1:{w.events_port}",
            }
            for w in cluster.workers
        ],
    }


@dataclass
class RouterProcess:
    """A router in front of the cluster; `url` is its OpenAI base URL."""

    label: str
    process: ManagedProcess
    url: str
    health_path: str = "/health"

    def stop(self) -> None:
        self.process.stop()


def start_ownerserve(
    cluster: EmulatedCluster,
    policy: str,
    log_dir: Path,
    label: str | None = None,
    planner: Mapping[str, object] | None = None,
) -> RouterProcess:
    port = free_port()
    label = label or policy
    cfg = log_dir / f"ownerserve_{policy}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    data = ownerserve_config(cluster, port, policy, planner=planner)
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = ManagedProcess(
        f"ownerserve ({policy})",
        [sys.executable, "-m", "ownerserve", "serve", "--config", str(cfg)],
        log_dir / f"router_{label}.log",
    ).start()
    router = RouterProcess(label, proc, f"http://127.0.0.1:{port}")
    _wait_router(router)
    return router


PEER_MODES: dict[str, tuple[str, str, bool]] = {
    # label: (peer, policy, pd mode)
    "vllm-router cache_aware": ("vllm-router", "cache_aware", False),
    "vllm-router consistent_hash": ("vllm-router", "consistent_hash", False),
    "vllm-router pd cache_aware": ("vllm-router", "cache_aware", True),
    "sglang-router cache_aware": ("sglang-router", "cache_aware", False),
    "sglang-router pd cache_aware": ("sglang-router", "cache_aware", True),
}


def peer_command(
    binary: Path, peer: str, policy: str, pd: bool, cluster: EmulatedCluster, port: int
) -> list[str]:
    """The peer router's command line for this cluster.

    Regular mode routes over every worker (each serves whole requests, as colocated engines).
    vllm-router's P/D mode sends prefill to the prefill workers and half the hybrids, decode to
    the decode workers and the other half (a vLLM `kv_both` engine can take either side).
    sglang-router's P/D mode uses the prefill and decode workers only: an SGLang server is in
    prefill or decode disaggregation mode, and a hybrid (mode "null") cannot join a P/D pair."""
    cmd = [str(binary)]
    if peer == "sglang-router":
        cmd.append("launch")
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        policy,
        "--log-level",
        "warning" if peer == "vllm-router" else "warn",
    ]
    if not pd:
        cmd += ["--worker-urls", *(w.url for w in cluster.workers)]
        return cmd
    hybrids = cluster.by_role("hybrid") if peer == "vllm-router" else []
    prefill = cluster.by_role("prefill") + hybrids[: (len(hybrids) + 1) // 2]
    decode = cluster.by_role("decode") + hybrids[(len(hybrids) + 1) // 2 :]
    cmd.append("--vllm-pd-disaggregation" if peer == "vllm-router" else "--pd-disaggregation")
    for w in prefill:
        cmd += ["--prefill", w.url]
        if peer == "sglang-router":
            cmd.append(str(w.bootstrap_port))
    for w in decode:
        cmd += ["--decode", w.url]
    return cmd


def start_peer(binary: Path, label: str, cluster: EmulatedCluster, log_dir: Path) -> RouterProcess:
    peer, policy, pd = PEER_MODES[label]
    port = free_port()
    cmd = peer_command(binary, peer, policy, pd, cluster, port)
    slug = label.replace(" ", "_")
    proc = ManagedProcess(label, cmd, log_dir / f"router_{slug}.log").start()
    router = RouterProcess(label, proc, f"http://127.0.0.1:{port}")
    _wait_router(router)
    return router


def _wait_router(router: RouterProcess, timeout_s: float = 60.0) -> None:
    """Healthy when `/health` answers 200 and a `/v1/models` listing works (peers report
    health before they have probed their workers)."""
    try:
        wait_healthy([(router.process, router.url)], timeout_s=timeout_s, path=router.health_path)
    except Exception:
        router.stop()
        raise
