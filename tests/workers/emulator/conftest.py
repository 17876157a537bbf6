"""Fixtures for the emulated engine's tests: engines on real loopback sockets in this process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from workers.emulator.config import EmulatorConfig
from workers.emulator.server import EmulatorServer

StartEmulator = Callable[..., Awaitable[EmulatorServer]]


@pytest.fixture
async def start_emulator() -> AsyncIterator[StartEmulator]:
    """Call with `EmulatorConfig` fields to start an engine on a free port; stopped at teardown."""
    servers: list[EmulatorServer] = []

    async def start(**overrides: Any) -> EmulatorServer:
        fields: dict[str, Any] = {"port": 0, "profile": "fast-test"}
        fields.update(overrides)
        server = EmulatorServer(EmulatorConfig(**fields))
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        yield client


def write_profile(tmp_path: Path, name: str = "slow-prefill", **changes: Any) -> str:
    """A timing profile YAML with measurable prefill (1 ms/token) and tiny decode steps."""
    data: dict[str, Any] = {
        "name": name,
        "prefill": {"base_s": 0.0, "per_token_s": 1.0e-3, "per_token_ctx_s": 0.0},
        "decode": {"base_s": 0.0005, "per_seq_s": 0.0, "per_ctx_token_s": 0.0},
        "link": {
            "intra_node_bps": 4.0e11,
            "inter_node_bps": 2.5e10,
            "latency_s": 0.0,
            "cpu_load_bps": 5.0e10,
            "ssd_load_bps": 6.0e9,
        },
        "kv_bytes_per_token": 131072,
        "hbm_kv_bytes": 1.0e9,
        "max_num_seqs": 256,
        "max_batched_tokens": 8192,
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
                found = True
    if not found:
        raise KeyError(f"no sample {name} {labels}")
    return total


async def timed_post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """POST `body` to the endpoint `url`: (the answer's JSON, seconds it took)."""
    t0 = time.perf_counter()
    resp = await http.post(url, json=body)
    resp.raise_for_status()
    return resp.json(), time.perf_counter() - t0


async def scrape(client: httpx.AsyncClient, server: EmulatorServer) -> str:
    resp = await client.get(server.url + "/metrics")
    resp.raise_for_status()
    return resp.text
