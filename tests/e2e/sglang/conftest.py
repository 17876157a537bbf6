"""Fixtures that run real SGLang CPU servers (marker `sglang`): the cached SGLang install and two
colocated instances publishing KV events, in front of which the tests put the router.

The install (`workers.sglang_cpu.setup`, minutes when cold; `scripts/test.sh` builds it before
pytest) is skipped with its error as the reason where it cannot be made (no package index,
say): every test here then skips and says why. Package scope: the servers start when the first
test needing them runs and stop when this package's tests are done. Every server binds
127.0.0.1 on free ports.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ownerserve.config import Settings, settings_from_dict
from ownerserve.ports import free_port
from workers.engine_process import EngineStartError
from workers.sglang_cpu.server import SglangServer, SglangServerSpec
from workers.sglang_cpu.setup import SglangCpuInstall, ensure
from workers.vllm_cpu.model import SERVED_NAME

READY_TIMEOUT_S = 600.0  # ~15 s on a quiet 2-core machine; far more beside heavy work
BLOCK = 32  # the servers' KV page size (`SglangServerSpec.page_size`), the router's block size
ADMIN = "adm"
LOG_TAIL_CHARS = 6000


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


def _start(install: SglangCpuInstall, work_dir: Path, names: Sequence[str]) -> list[SglangServer]:
    servers = [
        SglangServer(
            install,
            SglangServerSpec(
                name=name,
                port=free_port(),
                page_size=BLOCK,
                kv_events_port=free_port(),
                kv_events_replay_port=free_port(),
            ),
            work_dir,
        )
        for name in names
    ]
    for s in servers:
        s.start()
    try:
        for s in servers:
            took = s.wait_ready(READY_TIMEOUT_S)
            warm = s.warm_up(READY_TIMEOUT_S)
            print(f"\nSGLang {s.name} ready in {took:.1f} s, warm-up {warm:.1f} s")
    except (EngineStartError, BaseException):
        for s in servers:
            s.stop()
        raise
    return servers


@pytest.fixture(scope="package")
def sglang_pair(
    sglang_install: SglangCpuInstall, sglang_work_dir: Path
) -> Iterator[tuple[SglangServer, SglangServer]]:
    """Two colocated SGLang servers (`s0`, `s1`), each publishing its KV events (with replay)."""
    s0, s1 = _start(sglang_install, sglang_work_dir, ("s0", "s1"))
    yield s0, s1
    for s in (s0, s1):
        s.stop()


def sglang_worker(worker_id: str, server: SglangServer) -> dict[str, Any]:
    """The router's settings entry of `server`: `kind: sglang`, with its KV event sockets."""
    return {
        "id": worker_id,
        "url": server.url,
        "role": "hybrid",
        "kind": "sglang",
        "models": [SERVED_NAME],
        "kv_events_endpoint": server.spec.kv_events_endpoint,
        "kv_events_replay_endpoint": server.spec.kv_events_replay_endpoint,
    }


def sglang_router_settings(
    install: SglangCpuInstall,
    workers: Sequence[Mapping[str, Any]],
    policy: str = "ownerserve",
) -> Settings:
    """A router in front of `workers` (`sglang_worker` entries) serving the tiny model with its
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
            "workers": list(workers),
        }
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test of this package carries the tails of its servers' logs in its report."""
    report = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            for part in value if isinstance(value, tuple | list) else (value,):
                path = getattr(part, "log_path", None)
                if isinstance(path, Path) and path.exists():
                    tail = path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
                    report.sections.append((f"log of {name}: {path.name}", tail))
    return report
