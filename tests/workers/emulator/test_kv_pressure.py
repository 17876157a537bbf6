"""What an emulated engine does when KV runs out, as vLLM does: requests queue for blocks,
running ones are preempted and recomputed, a decode side allocates before it pulls (so it
never deadlocks holding pulled KV), and a prefill side frees KV nobody pulls once its lease
runs out or its decode side lets go. Engines on real loopback sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from tests.waiting import until
from tests.workers.emulator.conftest import StartEmulator, metric_value, scrape, write_profile
from workers.emulator.server import EmulatorServer

HELD = "ownerserve_emulator_kv_transfers_held"
EXPIRED = "ownerserve_emulator_kv_transfers_expired_total"
IN_USE = "ownerserve_emulator_kv_blocks_in_use"


def messages(i: int, size: int = 180) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{i:03d} " + "z" * size}]


def prompt_blocks(msgs: list[dict[str, str]]) -> int:
    return -(-len(ByteTokenizer().encode(ChatTemplate().render(msgs))) // 16)


async def prefill(http: httpx.AsyncClient, p: EmulatorServer, msgs: Any) -> dict[str, Any]:
    body = {"messages": msgs, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    resp = await http.post(p.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    ktp: dict[str, Any] = resp.json()["kv_transfer_params"]
    return ktp


async def decode(
    http: httpx.AsyncClient, d: EmulatorServer, msgs: Any, ktp: dict[str, Any], n: int
) -> dict[str, Any]:
    body = {"messages": msgs, "max_tokens": n, "ignore_eos": True, "kv_transfer_params": ktp}
    resp = await http.post(d.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def test_preempted_requests_complete_with_their_requested_output_length(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(num_blocks=16)
    bodies = [
        {"messages": messages(i, 40), "max_tokens": 70, "ignore_eos": True, "stream": stream}
        for i in range(6)
        for stream in (False, True)
    ]
    async with asyncio.timeout(30):
        resps = await asyncio.gather(
            *(http.post(server.url + "/v1/chat/completions", json=b) for b in bodies)
        )
    for b, resp in zip(bodies, resps, strict=True):
        assert resp.status_code == 200
        if b["stream"]:
            chunks = [line for line in resp.text.splitlines() if line.startswith("data: {")]
            assert len(chunks) == 70 + 1  # one per token, then the finish chunk
        else:
            assert resp.json()["usage"]["completion_tokens"] == 70
            assert resp.json()["choices"][0]["finish_reason"] == "length"
    text = await scrape(http, server)
    assert metric_value(text, "vllm:num_preemptions_total") > 0
    assert metric_value(text, IN_USE) == 0


async def test_decodes_beyond_the_decode_sides_kv_queue_for_blocks_and_all_complete(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    # Each request needs ~13 blocks of the decode side's 24: at most one runs there at a time.
    # A decode side that pulled before allocating would hold every prompt's KV and deadlock.
    p = await start_emulator(role="prefill")
    d = await start_emulator(role="decode", num_blocks=24)
    prompts = [messages(i) for i in range(6)]
    assert 2 * prompt_blocks(prompts[0]) > 24
    params = [await prefill(http, p, m) for m in prompts]
    assert metric_value(await scrape(http, p), HELD) == 6
    async with asyncio.timeout(30):
        outs = await asyncio.gather(
            *(decode(http, d, m, ktp, 40) for m, ktp in zip(prompts, params, strict=True))
        )
    assert all(o["usage"]["completion_tokens"] == 40 for o in outs)
    d_text, p_text = await scrape(http, d), await scrape(http, p)
    assert metric_value(d_text, "ownerserve_emulator_kv_received_blocks_total", kind="pd") > 0
    assert metric_value(d_text, IN_USE) == 0
    assert metric_value(p_text, HELD) == 0 and metric_value(p_text, EXPIRED) == 0
    assert metric_value(p_text, IN_USE) == 0


Prefilled = tuple[list[dict[str, str]], dict[str, Any]]


async def running_on(http: httpx.AsyncClient, d: EmulatorServer) -> None:
    """Until a decode runs on `d` (its blocks allocated): what comes next queues behind it."""

    async def running() -> bool:
        return metric_value(await scrape(http, d), "vllm:num_requests_running") == 1

    await until(running, what="the first decode running")


async def two_prefilled_for_a_slow_decode(
    start_emulator: StartEmulator,
    http: httpx.AsyncClient,
    tmp_path: Path,
    kv_lease_s: float,
    step_s: float = 0.01,
) -> tuple[EmulatorServer, EmulatorServer, Prefilled, Prefilled]:
    """A prefill side and a decode side of 24 blocks whose decode steps take `step_s`, and two
    conversations prefilled on the prefill side: (p, d, and each conversation's messages with
    its `kv_transfer_params`)."""
    profile = write_profile(tmp_path, decode__base_s=step_s, prefill__per_token_s=1e-5)
    p = await start_emulator(role="prefill", profile=profile, kv_lease_s=kv_lease_s)
    d = await start_emulator(role="decode", profile=profile, num_blocks=24, kv_lease_s=kv_lease_s)
    first, second = messages(1), messages(2)
    ktp1, ktp2 = await prefill(http, p, first), await prefill(http, p, second)
    return p, d, (first, ktp1), (second, ktp2)


async def test_a_decode_queued_for_blocks_keeps_its_prefill_kv_alive_past_the_lease(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # the lease outlasts the few moments from the prefills to the second decode's arrival
    # (seconds on a loaded box, before any renewal can run); the first decode outlasts it 2x
    lease_s = 2.0
    p, d, (first, ktp1), (second, ktp2) = await two_prefilled_for_a_slow_decode(
        start_emulator, http, tmp_path, kv_lease_s=lease_s, step_s=0.04
    )
    t0 = time.perf_counter()
    async with asyncio.timeout(120):
        one = asyncio.create_task(decode(http, d, first, ktp1, 150))  # >= 6 s of decode steps
        await running_on(http, d)
        two = await decode(http, d, second, ktp2, 4)  # queued behind it, for blocks
        await one
    assert time.perf_counter() - t0 > 2 * lease_s  # the second waited well past its lease
    assert two["usage"]["completion_tokens"] == 4
    p_text = await scrape(http, p)
    assert metric_value(p_text, EXPIRED) == 0 and metric_value(p_text, HELD) == 0


async def test_a_decode_abandoned_while_queued_frees_its_prefill_kv_at_once(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    p, d, (first, ktp1), (second, ktp2) = await two_prefilled_for_a_slow_decode(
        start_emulator, http, tmp_path, kv_lease_s=30
    )
    one = asyncio.create_task(decode(http, d, first, ktp1, 150))
    await running_on(http, d)
    body = {"messages": second, "max_tokens": 4, "kv_transfer_params": ktp2}
    try:
        await http.post(d.url + "/v1/chat/completions", json=body, timeout=0.3)
        raise AssertionError("the queued decode answered before its client gave up")
    except httpx.TimeoutException:
        pass

    async def released() -> bool:
        return metric_value(await scrape(http, p), HELD) == 0 or one.done()

    await until(released, what="the abandoned decode's prefill KV released")
    p_text = await scrape(http, p)
    assert metric_value(p_text, HELD) == 0 and metric_value(p_text, EXPIRED) == 0
    assert not one.done()  # freed by the decode side's release, long before any lease ran out
    assert (await one)["usage"]["completion_tokens"] == 150


async def test_a_decode_keeps_its_local_prefix_when_allocating_evicts_the_cache(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    # The decode side's cache is full of idle blocks, its own prefix the least recently used:
    # allocating the rest of the prompt must not evict the prefix it reuses.
    p = await start_emulator(role="prefill")
    d = await start_emulator(role="decode", num_blocks=24)
    mine, other = messages(1, 120), messages(2, 180)
    assert prompt_blocks(mine) + prompt_blocks(other) == 24
    for msgs in (mine, other):
        resp = await http.post(
            d.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}
        )
        assert resp.status_code == 200
    longer = [{"role": "user", "content": mine[0]["content"] + "w" * 80}]  # 5 blocks more
    ktp = await prefill(http, p, longer)
    async with asyncio.timeout(10):
        out = await decode(http, d, longer, ktp, 4)
    assert out["usage"]["completion_tokens"] == 4
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
