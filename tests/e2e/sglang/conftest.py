"""Fixtures that run real SGLang CPU servers (marker `sglang`): the cached SGLang install, two
colocated instances publishing KV events, and a prefill + decode pair meeting at bootstrap rooms
over Mooncake's TCP transport, in front of which the tests put the router.

The install (`workers.sglang_cpu.setup`, minutes when cold; `scripts/test.sh` builds it before
pytest) is skipped with its error as the reason where it cannot be made (no package index,
say): every test here then skips and says why. Package scope: the servers start when the first
test needing them runs and stop when this package's tests are done. Every server binds
127.0.0.1 on free ports.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from ownerserve.config import Settings, settings_from_dict
from ownerserve.ports import free_port
from ownerserve.types import Role
from router.backends.sglang import new_bootstrap_room
from tests.e2e.engine_logs import pytest_runtest_makereport  # noqa: F401 (this package's hook)
from workers.engine_process import EngineStartError
from workers.sglang_cpu.server import SglangServer, SglangServerSpec
from workers.sglang_cpu.setup import SglangCpuInstall, ensure
from workers.vllm_cpu.model import SERVED_NAME

READY_TIMEOUT_S = 600.0  # ~15 s on a quiet 2-core machine; far more beside heavy work
BLOCK = 32  # the servers' KV page size (`SglangServerSpec.page_size`), the router's block size
ADMIN = "adm"


@pytest.fixture(scope="package")
def sglang_install() -> SglangCpuInstall:
    """The SGLang venv and tiny model, installed once into the user cache; the package's tests
    skip with the install's error when it cannot be built here."""
    started = time.monotonic()
    try:
        inst = ensure()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"the SGLang CPU install (workers.sglang_cpu.setup) failed here: {exc!r}")
    print(f"\nsglang-cpu setup ready in {time.monotonic() - started:.1f} s")
    return inst


@pytest.fixture(scope="package")
def sglang_work_dir() -> Path:
    """Server logs; outside pytest's rotating basetemp so a failed run's logs survive."""
    path = Path(tempfile.mkdtemp(prefix="ownerserve-sglang-"))
    print(f"\nSGLang logs in {path}")
    return path


def _colocated(install: SglangCpuInstall, work_dir: Path, name: str) -> SglangServer:
    spec = SglangServerSpec(
        name=name,
        port=free_port(),
        page_size=BLOCK,
        kv_events_port=free_port(),
        kv_events_replay_port=free_port(),
    )
    return SglangServer(install, spec, work_dir)


def _warm_up_pd(prefill: SglangServer, decode: SglangServer) -> None:
    """One short completion sent to both sides at a bootstrap room, as the router sends it."""
    body = {
        "model": SERVED_NAME,
        "prompt": "warm up " * 40,
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.spec.bootstrap_port,
        "bootstrap_room": new_bootstrap_room(),
    }

    async def both() -> None:
        async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as client:
            answers = await asyncio.gather(
                *(client.post(s.url + "/v1/completions", json=body) for s in (prefill, decode))
            )
        for s, r in zip((prefill, decode), answers, strict=True):
            if r.status_code != 200:
                raise EngineStartError(f"{s.name}: P/D warm-up answered {r.status_code}: {r.text}")

    asyncio.run(both())


def _start(servers: list[SglangServer], pd: bool = False) -> list[SglangServer]:
    for s in servers:
        s.start()
    try:
        for s in servers:
            took = s.wait_ready(READY_TIMEOUT_S)
            print(f"\nSGLang {s.name} ready in {took:.1f} s")
        if pd:
            _warm_up_pd(*servers)
        else:
            for s in servers:
                s.warm_up(READY_TIMEOUT_S)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@pytest.fixture(scope="package")
def sglang_pair(
    sglang_install: SglangCpuInstall, sglang_work_dir: Path
) -> Iterator[tuple[SglangServer, SglangServer]]:
    """Two colocated SGLang servers (`s0`, `s1`), each publishing its KV events (with replay)."""
    s0, s1 = _start([_colocated(sglang_install, sglang_work_dir, name) for name in ("s0", "s1")])
    yield s0, s1
    for s in (s0, s1):
        s.stop()


@pytest.fixture(scope="package")
def sglang_pd_pair(
    sglang_install: SglangCpuInstall, sglang_work_dir: Path
) -> Iterator[tuple[SglangServer, SglangServer]]:
    """A prefill server (with its bootstrap port) and a decode server (`sp0`, `sd0`)."""
    specs = (
        SglangServerSpec("sp0", free_port(), Role.PREFILL, bootstrap_port=free_port()),
        SglangServerSpec("sd0", free_port(), Role.DECODE),
    )
    servers = [SglangServer(sglang_install, s, sglang_work_dir) for s in specs]
    prefill, decode = _start(servers, pd=True)
    yield prefill, decode
    for s in (prefill, decode):
        s.stop()


def sglang_worker(server: SglangServer) -> dict[str, Any]:
    """The router's settings entry of `server` (its id the server's name): `kind: sglang` in its
    role, with its KV event sockets when it publishes events and its bootstrap port when it is a
    prefill server."""
    spec = server.spec
    entry: dict[str, Any] = {
        "id": server.name,
        "url": server.url,
        "role": str(spec.role),
        "kind": "sglang",
        "models": [SERVED_NAME],
    }
    if spec.kv_events_endpoint is not None:
        entry["kv_events_endpoint"] = spec.kv_events_endpoint
        entry["kv_events_replay_endpoint"] = spec.kv_events_replay_endpoint
    if spec.bootstrap_port is not None:
        entry["bootstrap_port"] = spec.bootstrap_port
    return entry


def sglang_router_settings(
    install: SglangCpuInstall,
    servers: Sequence[SglangServer],
    policy: str = "ownerserve",
) -> Settings:
    """A router in front of `servers` (`sglang_worker` entries) serving the tiny model with its
    own tokenizer (the engine's), health checked every 0.5 s, `/admin` behind `ADMIN`."""
    return settings_from_dict(
        {
            "server": {
                "port": 0,
                "health_interval_s": 0.5,
                "connect_timeout_s": 5.0,
                "admin_token": ADMIN,
            },
            "planner": {"policy": policy},
            "models": [
                {
                    "name": SERVED_NAME,
                    "tokenizer": str(Path(install.model) / "tokenizer.json"),
                    "block_size": BLOCK,
                    "max_model_len": 2048,
                }
            ],
            "workers": [sglang_worker(s) for s in servers],
        }
    )
