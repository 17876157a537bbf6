"""vllm-router and sglang-router (real binaries in their own venvs) route to emulated engines,
plain and in their P/D modes, and requests complete: the emulator speaks the ecosystem's wire.

Slow (starts router processes; installs them once into `~/.cache/ownerserve/peers` if missing);
skips with the reason when a peer cannot be installed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.peers import PeerUnavailableError, peer_binary
from ownerserve.ports import free_port
from tests.workers.emulator.conftest import StartEmulator, metric_value, scrape
from workers.emulator.config import DEFAULT_MODEL as MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def binary(name: str) -> Path:
    try:
        return peer_binary(name)
    except PeerUnavailableError as exc:
        pytest.skip(f"{name} unavailable: {exc}")


@contextlib.contextmanager
def router(cmd: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def wait_routing(
    http: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0
) -> None:
    """Until the router answers a real completion (workers discovered and healthy)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"router exited {proc.returncode}: {err[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            resp = await http.post(url + "/v1/chat/completions", json=chat("warm up", 2))
            if resp.status_code == 200:
                return
            last = f"{resp.status_code} {resp.text[:200]}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"router at {url} not routing after {timeout_s}s: {last}")


def chat(content: str, max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


async def complete_both_ways(http: httpx.AsyncClient, url: str, tag: str) -> None:
    prompt = f"{tag}: route this agent turn through the peer router please " * 3
    resp = await http.post(url + "/v1/chat/completions", json=chat(prompt, 12))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 12
    text = ""
    async with http.stream(
        "POST", url + "/v1/chat/completions", json=chat(prompt + " again", 9, stream=True)
    ) as streamed:
        assert streamed.status_code == 200
        async for line in streamed.aiter_lines():
            text += line + "\n"
    assert text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in text


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60.0) as client:
        yield client


@contextlib.asynccontextmanager
async def routing(http: httpx.AsyncClient, cmd: list[str], *flags: str) -> AsyncIterator[str]:
    """The peer router `cmd` run with `flags` on free loopback ports, once it routes a real
    completion: yields its base URL; stopped on exit."""
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port),
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    with router([*cmd, *common, *flags]) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_routing(http, url, proc)
        yield url


async def test_vllm_router_pd_mode_moves_kv_between_emulated_workers(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    exe = binary("vllm-router")
    p = await start_emulator(role="prefill")
    d = await start_emulator(role="decode")
    flags = ("--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url)
    async with routing(http, [str(exe)], *flags) as url:
        await complete_both_ways(http, url, "vllm-pd")
    received = metric_value(await scrape(http, d), "ownerserve_emulator_kv_received_blocks_total")
    assert received > 0
    sent = metric_value(await scrape(http, p), "ownerserve_emulator_kv_sent_blocks_total")
    assert sent == received


async def test_vllm_router_round_robin_over_hybrid_workers(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    exe = binary("vllm-router")
    workers = [await start_emulator(), await start_emulator()]
    flags = ("--policy", "round_robin", "--worker-urls", *(w.url for w in workers))
    async with routing(http, [str(exe)], *flags) as url:
        for i in range(4):
            await complete_both_ways(http, url, f"rr{i}")
    served = [metric_value(await scrape(http, w), "vllm:request_success_total") for w in workers]
    assert all(n >= 4 for n in served)


async def test_sglang_router_pd_mode_with_bootstrap_rooms(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    exe = binary("sglang-router")
    p = await start_emulator(role="prefill", bootstrap_port=0)
    d = await start_emulator(role="decode")
    bootstrap = str(p.config.bootstrap_port)
    flags = ("--pd-disaggregation", "--prefill", p.url, bootstrap, "--decode", d.url)
    async with routing(http, [str(exe), "launch"], *flags) as url:
        await complete_both_ways(http, url, "sglang-pd")
    received = metric_value(await scrape(http, d), "ownerserve_emulator_kv_received_blocks_total")
    assert received > 0
    assert metric_value(await scrape(http, p), "ownerserve_emulator_kv_transfers_held") == 0


async def test_sglang_router_plain_mode(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    exe = binary("sglang-router")
    w = await start_emulator()
    flags = ("--policy", "round_robin", "--worker-urls", w.url)
    async with routing(http, [str(exe), "launch"], *flags) as url:
        await complete_both_ways(http, url, "sglang-plain")
