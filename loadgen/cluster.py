"""The one launcher of a local emulated cluster: emulated engines, and the OwnerServe proxy or a
peer router (vllm-router, sglang-router) in front of them, as real processes on loopback ports.

The demo, the benchmarks and the e2e tests all start their workers here. Each child runs in its
own process group with its output in a log file; `stop()` ends the whole group. A child still
running when this process exits (normally, on an exception, or on SIGTERM inside
`sigterm_as_interrupt()`) is stopped then, so no emulated worker outlives its launcher holding
its ports. An emulated worker also holds a lifeline to its launcher (`ManagedProcess.lifeline`)
and exits by itself once the launcher is gone, even a SIGKILLed one that ran no cleanup.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeVar

import httpx
import yaml

from ownerserve.ports import free_port

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "ownerserve-tiny"
DEFAULT_PROFILE = "h100-llama3-8b"


class ProcessFailedError(RuntimeError):
    """A launched process exited or never became healthy; the message carries its log's tail."""


# Every started, not yet stopped child, by id(): stopped at exit, by the process that started it
# (a forked copy of this process, e.g. a process pool's worker, inherits the table, not them).
_RUNNING: dict[int, ManagedProcess] = {}


@dataclass(eq=False)
class ManagedProcess:
    """One child process in its own process group, its output in `log_path` (a temporary file,
    removed at `stop()`, when None)."""

    name: str
    cmd: list[str]
    log_path: Path | None = None
    env: dict[str, str] | None = None
    lifeline: str | None = None
    """The child's option that takes a file descriptor (`--lifeline-fd`): when set, the child
    gets the read end of a pipe whose write end only this process holds, and exits once that
    reads end of file, which is when this process is gone however it ended."""
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _temp_log: bool = field(default=False, repr=False)
    _parent_pid: int = field(default=0, repr=False)
    _lifeline_fd: int | None = field(default=None, repr=False)

    def start(self) -> ManagedProcess:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="ownerserve-", suffix=".log")
            os.close(fd)
            self.log_path, self._temp_log = Path(name), True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.cmd
        child_fds: tuple[int, ...] = ()
        if self.lifeline is not None:
            # A pipe rather than prctl(PR_SET_PDEATHSIG): the kernel closes the write end when
            # this process dies, however it dies, and the child reads end of file even when
            # that happened before it started watching, so there is no race to check for. The
            # parent-death signal fires when the thread that started the child ends (a worker
            # started from a thread pool would die with the thread), needs a preexec_fn (unsafe
            # beside threads, and it makes Popen fork instead of vfork) and exists on Linux
            # only. The write end is not inheritable (PEP 446): no other child holds it, only
            # a fork of this process that never execs (multiprocessing's "fork") keeps it.
            child_end, self._lifeline_fd = os.pipe()
            cmd, child_fds = [*self.cmd, self.lifeline, str(child_end)], (child_end,)
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=REPO_ROOT,
                env={**os.environ, **(self.env or {})},
                pass_fds=child_fds,
            )
        except BaseException:
            self._close_lifeline()
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        self._parent_pid = os.getpid()
        _RUNNING[id(self)] = self
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 1500) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole group: the process dies as a crashed one would (`stop()` still
        closes its log)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self, timeout_s: float = 8.0) -> None:
        """SIGTERM the whole group, SIGKILL it if still there after `timeout_s`."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        _RUNNING.pop(id(self), None)
        self._close_lifeline()
        if self._log is not None:
            self._log.close()
            self._log = None
            if self._temp_log and self.log_path is not None:
                self.log_path.unlink(missing_ok=True)

    def _close_lifeline(self) -> None:
        if self._lifeline_fd is not None:
            os.close(self._lifeline_fd)
            self._lifeline_fd = None


@atexit.register
def _stop_running() -> None:
    for p in list(_RUNNING.values()):
        if p._parent_pid == os.getpid():
            p.stop(timeout_s=5.0)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside (in the main thread), SIGTERM raises `KeyboardInterrupt` as Ctrl-C does, so
    the caller's `finally` blocks and the at-exit stop of every child run. Python's default
    SIGTERM ends the process at once and would leave the children running, holding their
    ports. A second SIGTERM is ignored while the first one's cleanup runs (bounded by
    `ManagedProcess.stop`'s timeouts)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


class LoopbackServer:
    """A child server on a loopback port (picked when it is made, so its URL is known before it
    starts and stays the same over restarts) and its process once started."""

    port: int
    process: ManagedProcess | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed one would, mid-request."""
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass(eq=False)
class EmulatedWorker(LoopbackServer):
    """One emulated engine (`python -m workers.emulator`) on loopback ports picked when it is
    made (so its URL is known before it starts, and stays the same over restarts)."""

    worker_id: str
    role: str
    kind: str = "emulator"
    """The router's worker kind: `emulator` or `sglang` (the emulator speaks both)."""
    profile: str = DEFAULT_PROFILE
    speed: float = 1.0
    model: str = MODEL
    extra: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    bootstrap_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    sidecar_url: str | None = None
    """Its own KV sidecar (`KVSidecar`): its KV is saved there and loaded from there, and the
    router's fetches go through it; None: it serves its KV API itself."""
    process: ManagedProcess | None = None

    def command(self) -> list[str]:
        # the child runs in REPO_ROOT: a profile given as a relative path means the caller's
        profile = (
            str(Path(self.profile).resolve()) if Path(self.profile).is_file() else self.profile
        )
        return [
            sys.executable, "-m", "workers.emulator",
            "--role", self.role, "--port", str(self.port), "--profile", profile,
            "--speed", str(self.speed), "--model", self.model, "--worker-id", self.worker_id,
            "--bootstrap-port", str(self.bootstrap_port),
            "--kv-events-port", str(self.events_port), *self.extra,
            *(("--sidecar-url", self.sidecar_url) if self.sidecar_url else ()),
        ]  # fmt: skip

    def start(self) -> EmulatedWorker:
        """Start the process (a fresh one, with cold caches, on the same ports)."""
        name = f"worker {self.worker_id}"
        self.process = ManagedProcess(
            name, self.command(), self.log_path, lifeline="--lifeline-fd"
        ).start()
        return self

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        assert self.process is not None, "start() first"
        wait_healthy([(self.process, self.url)], timeout_s=timeout_s)

    def metrics(self) -> str:
        """Its Prometheus exposition text."""
        return httpx.get(self.url + "/metrics", timeout=5.0).text

    def worker_settings(self) -> dict[str, Any]:
        """Its entry in the router's `workers` settings."""
        out: dict[str, Any] = {
            "id": self.worker_id,
            "url": self.url,
            "role": self.role,
            "kind": self.kind,
            "models": [self.model],
            "bootstrap_port": self.bootstrap_port,
            "kv_events_endpoint": f"tcp://127.0.0.1:{self.events_port}",
        }
        if self.profile != DEFAULT_PROFILE:
            out["profile"] = self.profile
        if self.sidecar_url is not None:
            out["sidecar_url"] = self.sidecar_url
        cpu_blocks = _flag(self.extra, "--cpu-num-blocks")
        if cpu_blocks:
            out["cpu_kv_tokens"] = cpu_blocks * (_flag(self.extra, "--block-size") or 16)
        return out


@dataclass(eq=False)
class KVSidecar(LoopbackServer):
    """One worker's KV sidecar (`ownerserve worker sidecar`, workers/sidecar) on a loopback
    port picked when it is made; `extra` carries its directory and store options."""

    worker_id: str
    store_dir: Path
    extra: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "ownerserve", "worker", "sidecar",
            "--worker-id", self.worker_id, "--port", str(self.port),
            "--store-dir", str(self.store_dir), *self.extra,
        ]  # fmt: skip

    def start(self) -> KVSidecar:
        """Start the process (a fresh one on the same port: its memory tier empty)."""
        name = f"sidecar {self.worker_id}"
        self.process = ManagedProcess(name, self.command(), self.log_path).start()
        return self

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        assert self.process is not None, "start() first"
        wait_healthy([(self.process, self.url)], timeout_s=timeout_s)


def _flag(args: Sequence[str], name: str) -> int:
    """The integer value of `name` in an emulator's extra arguments (0 when absent)."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith(name + "="):
            return int(a.split("=", 1)[1])
    return 0


def start_workers(workers: Sequence[EmulatedWorker], timeout_s: float = 90.0) -> None:
    """Start every worker, then wait until all are healthy; on a failure stop them all."""
    try:
        for w in workers:
            w.start()
        wait_healthy([(w.process, w.url) for w in workers if w.process], timeout_s=timeout_s)
    except BaseException:
        for w in workers:
            w.stop()
        raise


@contextlib.contextmanager
def emulated_workers(*workers: EmulatedWorker) -> Iterator[tuple[EmulatedWorker, ...]]:
    """The workers, started and healthy, inside; stopped on the way out."""
    start_workers(workers)
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """An emulated xPyD cluster: how many workers of each role and their timing."""

    prefill: int = 2
    decode: int = 2
    hybrid: int = 2
    profile: str = DEFAULT_PROFILE
    speed: float = 1.0
    model: str = MODEL
    extra_args: tuple[str, ...] = ()


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
        self.workers: list[EmulatedWorker] = []
        for prefix, role in roles:
            i = counts[prefix] = counts.get(prefix, -1) + 1
            wid = f"{prefix}{i}"
            self.workers.append(
                EmulatedWorker(
                    wid,
                    role,
                    profile=spec.profile,
                    speed=spec.speed,
                    model=spec.model,
                    extra=spec.extra_args,
                    log_path=log_dir / f"worker_{wid}.log",
                )
            )
        self.generation = 0

    def start(self) -> EmulatedCluster:
        self.generation += 1
        start_workers(self.workers)
        return self

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def by_role(self, *roles: str) -> list[EmulatedWorker]:
        return [w for w in self.workers if w.role in roles]

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process and w.process.pid is not None]


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
                # its fetches through its sidecar, which pulls blocks, not chunks
                **(
                    {"sidecar_url": w.sidecar_url, "kv_paths": ["nixl_pd", "sidecar"]}
                    if w.sidecar_url
                    else {}
                ),
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


def peer_pools(
    peer: str, prefill: Sequence[T], decode: Sequence[T], hybrid: Sequence[T]
) -> tuple[list[T], list[T]]:
    """(prefill, decode) workers a peer's P/D mode routes to, from a cluster's workers by role:
    vllm-router's adds the first half of the hybrids to the prefill workers and the other half
    to the decode workers (a vLLM `kv_both` engine can take either side); sglang-router's
    leaves the hybrids out (an SGLang server is in prefill or decode disaggregation mode, and
    a hybrid, mode "null", cannot join a P/D pair)."""
    hybrids = list(hybrid) if peer == "vllm-router" else []
    half = (len(hybrids) + 1) // 2
    return [*prefill, *hybrids[:half]], [*decode, *hybrids[half:]]


def peer_mode_unfit(label: str, spec: ClusterSpec) -> str | None:
    """Why the peer mode `label` cannot run on `spec`'s cluster (a P/D mode with no prefill or
    no decode worker to route to), or None when it can."""
    peer, _, pd = PEER_MODES[label]
    if not pd:
        return None
    ps, ds = peer_pools(peer, range(spec.prefill), range(spec.decode), range(spec.hybrid))
    p, d = len(ps), len(ds)
    if p and d:
        return None
    why = (
        " (an SGLang server in P/D runs in prefill or decode mode: a hybrid cannot join a pair)"
        if peer == "sglang-router"
        else ""
    )
    return (
        f"{label} would route prefill to {p} and decode to {d} of this cluster's workers "
        f"({spec.prefill} prefill, {spec.decode} decode, {spec.hybrid} hybrid) and needs one "
        f"of each{why}"
    )


def peer_command(
    binary: Path, peer: str, policy: str, pd: bool, cluster: EmulatedCluster, port: int
) -> list[str]:
    """The peer router's command line for this cluster.

    Regular mode routes over every worker (each serves whole requests, as colocated engines);
    P/D mode over the workers `peer_pools` gives it."""
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
    prefill, decode = peer_pools(
        peer, cluster.by_role("prefill"), cluster.by_role("decode"), cluster.by_role("hybrid")
    )
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
