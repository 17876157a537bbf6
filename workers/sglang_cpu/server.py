"""Start, await and stop real SGLang servers (`sglang.launch_server` on CPU) on loopback for tests
and demos.

A `SglangServerSpec` says what one instance is: its port, its role (colocated, or a P/D prefill
or decode server over Mooncake's TCP transport), KV page size (the router's block size, so
SGLang's KV events name the router's blocks), KV pool size, and whether it publishes KV events;
`SglangServer` runs it in its own process group (`workers.engine_process`).

Flags, and why: `--device cpu` with `--attention-backend torch_native` (the CPU backend SGLang
falls back to without Intel AMX, named so the fallback is not guessed); `--enable-metrics` for
the `/metrics` load gauges the router reads; `--enable-cache-report` so answers carry
`usage.prompt_tokens_details.cached_tokens`; `--skip-server-warmup` (its warm-up request would
run before the caller's own and count in its metrics); `--kv-events-config` with `bind: true`,
so SGLang binds the loopback endpoint and the router connects, as it does to a vLLM publisher.

P/D roles add `--disaggregation-mode prefill|decode` with `--disaggregation-transfer-backend
mooncake_tcp` (Mooncake's Transfer Engine forced onto TCP; the non-CUDA Mooncake wheel, so no
CUDA runtime is needed), a bootstrap port on the prefill side, `--disable-overlap-schedule`
(the overlapped scheduler records CUDA events on its forward stream), and on the decode side
`--disaggregation-decode-retraction-backup none` (its default host-pool backup registers host
memory with CUDA). Their processes also get `cpu_pd/` on the path: its `sitecustomize` gives
the prefill side's pinned-memory and CUDA-event calls their CPU meaning (see there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ownerserve.types import Role
from workers.engine_process import EngineProcess
from workers.sglang_cpu.setup import SglangCpuInstall, server_env
from workers.vllm_cpu.model import SERVED_NAME

KV_EVENTS_TOPIC = "kv-events"
CPU_PD = Path(__file__).with_name("cpu_pd")
"""Put on a P/D server's PYTHONPATH (its `sitecustomize`)."""


@dataclass(frozen=True, slots=True)
class SglangServerSpec:
    """One SGLang instance; ports are loopback TCP ports (`ownerserve.ports.free_port`)."""

    name: str
    port: int
    role: Role = Role.HYBRID
    bootstrap_port: int | None = None
    """The prefill role's bootstrap server (where a decode server meets it at a room)."""
    page_size: int = 32
    max_total_tokens: int = 16384
    """The KV pool's size in tokens (small, so a few long prompts force evictions)."""
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    served_model_name: str = SERVED_NAME
    model: Path | None = None
    """The model dir to serve; None: the install's tiny Llama (`SglangCpuInstall.model`)."""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        port = self.kv_events_port
        return None if port is None else f"tcp://127.0.0.1:{port}"

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        port = self.kv_events_replay_port
        return None if port is None else f"tcp://127.0.0.1:{port}"


def server_argv(install: SglangCpuInstall, spec: SglangServerSpec) -> list[str]:
    """The `python -m sglang.launch_server` command line for `spec`."""
    argv = [
        *(str(install.python), "-m", "sglang.launch_server"),
        *("--model-path", str(install.model if spec.model is None else spec.model)),
        *("--served-model-name", spec.served_model_name),
        *("--host", "127.0.0.1", "--port", str(spec.port)),
        *("--device", "cpu", "--attention-backend", "torch_native"),
        *("--page-size", str(spec.page_size), "--max-total-tokens", str(spec.max_total_tokens)),
        *("--enable-metrics", "--enable-cache-report", "--skip-server-warmup"),
    ]
    if spec.kv_events_endpoint is not None:
        events: dict[str, object] = {
            "publisher": "zmq",
            "endpoint": spec.kv_events_endpoint,
            "bind": True,
            "topic": KV_EVENTS_TOPIC,
        }
        if spec.kv_events_replay_endpoint is not None:
            events["replay_endpoint"] = spec.kv_events_replay_endpoint
        argv += ["--kv-events-config", json.dumps(events)]
    if spec.role is Role.PREFILL:
        if spec.bootstrap_port is None:
            raise ValueError(f"{spec.name}: a prefill server needs a bootstrap_port")
        argv += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    elif spec.role is Role.DECODE:
        argv += ["--disaggregation-decode-retraction-backup", "none"]
    if spec.role is not Role.HYBRID:
        argv += ["--disaggregation-mode", str(spec.role)]
        argv += ["--disaggregation-transfer-backend", "mooncake_tcp", "--disable-overlap-schedule"]
    return argv + list(spec.extra_args)


@dataclass(slots=True)
class SglangServer(EngineProcess):
    """An SGLang server process group; `start`, `wait_ready`, then `stop` (or `kill`)."""

    install: SglangCpuInstall
    spec: SglangServerSpec
    work_dir: Path

    def command(self) -> list[str]:
        return server_argv(self.install, self.spec)

    def environment(self) -> dict[str, str]:
        cache = self.work_dir / "cache"
        env = server_env()
        env.update(XDG_CACHE_HOME=str(cache / "xdg"), HF_HOME=str(cache / "hf"))
        if self.spec.role is not Role.HYBRID:
            env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{CPU_PD}"
        return env
