"""A real engine server (vLLM, SGLang) as a child process group on loopback: start it, wait until
its health endpoint answers, read its log, stop or kill the whole group.

`EngineProcess` is the lifecycle both engines' launchers (`workers.vllm_cpu.server`,
`workers.sglang_cpu.server`) share; each says only its command line, environment and URL. The
engine runs in its own session, so stopping it also stops every helper process it spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar, Protocol

import httpx

INTERPRETER_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
"""The caller's interpreter settings, which must not leak into an engine venv's interpreter."""


def engine_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without `INTERPRETER_ENV`."""
    return {
        k: v for k, v in (os.environ if base is None else base).items() if k not in INTERPRETER_ENV
    }


class EngineSpec(Protocol):
    """What `EngineProcess` reads of a server's spec."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def served_model_name(self) -> str: ...


class EngineStartError(RuntimeError):
    """The server exited or did not become healthy in time; carries the log tail."""


@dataclass(slots=True)
class EngineProcess:
    """Base of an engine's server dataclass (its fields keyword-only, after the subclass's own);
    subclasses give the fields `spec` and `work_dir`, and `command` and `environment`."""

    health_path: ClassVar[str] = "/health"
    process: subprocess.Popen[bytes] | None = field(default=None, kw_only=True)
    started_at: float = field(default=0.0, kw_only=True)
    ready_after_s: float | None = field(default=None, kw_only=True)
    _log_file: object = field(default=None, kw_only=True, repr=False)

    @property
    def spec(self) -> EngineSpec:
        raise NotImplementedError

    @property
    def work_dir(self) -> Path:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def model_name(self) -> str:
        """The name the server serves its model under."""
        return self.spec.served_model_name

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.name}.log"

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log: IO[bytes] = self.log_path.open("wb")
        self._log_file = log
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            self.command(),
            env=self.environment(),
            cwd=self.work_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Block until the health endpoint answers 200; returns seconds since start."""
        if self.process is None:
            raise EngineStartError(f"{self.name}: not started")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    raise EngineStartError(f"{self.name} exited with {code}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.health_path).status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
                except httpx.TransportError:
                    pass
                time.sleep(1.0)
        raise EngineStartError(
            f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def warm_up(self, timeout_s: float = 300.0) -> float:
        """One short completion, so first-request set-up (tens of seconds on a busy CPU) is paid
        here rather than inside a caller's request timeout; returns its seconds."""
        started = time.monotonic()
        body = {
            "model": self.model_name,
            "prompt": "warm up " * 40,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise EngineStartError(f"{self.name}: warm-up answered {r.status_code}: {r.text}")
        return time.monotonic() - started

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a crash, as a client would see it."""
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after `grace_s`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        # Helpers (engine core, schedulers, resource tracker) may outlive the API server's exit.
        self._signal_group(signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=30)
        log = self._log_file
        if log is not None and hasattr(log, "close"):
            log.close()
