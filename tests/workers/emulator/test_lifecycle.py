"""Request and KV lifecycles: a client that goes away frees its blocks at once, held prefill KV
expires, and `--speed` scales the emulated time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson

from tests.waiting import until
from tests.workers.emulator.conftest import StartEmulator, metric_value, scrape, write_profile


async def test_client_disconnect_aborts_the_request_and_frees_its_blocks(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # 5 ms per decode step: 2000 tokens would take 10 s.
    server = await start_emulator(profile=write_profile(tmp_path, decode__base_s=0.005))
    body = orjson.dumps(
        {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 2000,
         "ignore_eos": True, "stream": True}
    )  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert b" 200 " in await reader.readline()
    while b'"content":"' not in await reader.readline():
        pass
    text = await scrape(http, server)
    assert metric_value(text, "vllm:num_requests_running") == 1
    assert metric_value(text, "ownerserve_emulator_kv_blocks_in_use") > 0
    writer.close()

    async def stopped() -> bool:
        nonlocal text
        text = await scrape(http, server)
        return metric_value(text, "vllm:num_requests_running") == 0

    await until(stopped, what="the abandoned request aborted")
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric_value(text, "ownerserve_emulator_kv_blocks_in_use") == 0
    assert metric_value(text, "vllm:generation_tokens_total") < 1000


async def test_unclaimed_prefill_kv_is_released_when_its_lease_runs_out(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    # long enough to see it held first, even on a busy machine
    p = await start_emulator(role="prefill", kv_lease_s=1.0)
    d = await start_emulator(role="decode")
    body = {
        "messages": [{"role": "user", "content": "prefill me and forget me " * 5}],
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = await http.post(p.url + "/v1/chat/completions", json=body)
    ktp = resp.json()["kv_transfer_params"]
    text = await scrape(http, p)
    assert metric_value(text, "ownerserve_emulator_kv_transfers_held") == 1
    assert metric_value(text, "ownerserve_emulator_kv_blocks_in_use") > 0

    async def released() -> bool:
        nonlocal text
        text = await scrape(http, p)
        return metric_value(text, "ownerserve_emulator_kv_transfers_held") == 0

    await until(released, what="the unclaimed hold released")
    assert metric_value(text, "ownerserve_emulator_kv_transfers_expired_total") == 1
    assert metric_value(text, "ownerserve_emulator_kv_blocks_in_use") == 0
    late = await http.post(
        d.url + "/v1/chat/completions", json={**body, "kv_transfer_params": ktp, "max_tokens": 4}
    )
    assert late.status_code == 400 and "expired" in late.json()["error"]["message"]


async def test_speed_divides_emulated_time(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # ~1.2 s of prefill at speed 1, ~0.12 s at speed 10: a busy machine's few hundred ms of
    # overhead still leave the second well under a third of the first
    profile = write_profile(tmp_path, prefill__per_token_s=4e-3)
    body = {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 1}
    times = []
    for speed in (1.0, 10.0):
        server = await start_emulator(profile=profile, speed=speed)
        t0 = time.perf_counter()
        resp = await http.post(server.url + "/v1/chat/completions", json=body)
        times.append(time.perf_counter() - t0)
        assert resp.status_code == 200
    assert times[0] > 1.2
    assert times[1] < times[0] / 3


async def test_a_request_waiting_for_blocks_held_for_a_transfer_runs_once_they_expire(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    lease_s = 0.5
    p = await start_emulator(role="prefill", num_blocks=20, kv_lease_s=lease_s)
    first = {
        "messages": [{"role": "user", "content": "a" * 230}],  # 15 full blocks, held
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    t0 = time.perf_counter()  # the hold starts after this, so it ends lease_s after it at least
    assert (await http.post(p.url + "/v1/chat/completions", json=first)).status_code == 200
    second = {"messages": [{"role": "user", "content": "b" * 230}], "max_tokens": 2}
    resp = await http.post(p.url + "/v1/chat/completions", json=second, timeout=10)
    took = time.perf_counter() - t0
    assert resp.status_code == 200
    # it ran once the hold expired (not before: there was no room), not at its 10 s timeout
    assert lease_s <= took < 10
    text = await scrape(http, p)
    assert metric_value(text, "ownerserve_emulator_kv_transfers_expired_total") == 1
