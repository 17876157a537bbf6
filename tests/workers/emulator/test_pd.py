"""P/D disaggregation between two emulated engines over real HTTP, as vLLM and SGLang speak it,
and the artifact fetch of the worker-side KV API."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from tests.waiting import until
from tests.workers.emulator.conftest import StartEmulator, metric_value, scrape, write_profile
from workers.emulator.config import DEFAULT_MODEL as MODEL
from workers.emulator.server import EmulatorServer

MESSAGES = [{"role": "user", "content": "summarise this repository for me please " * 6}]
PROMPT = ByteTokenizer().encode(ChatTemplate().render(MESSAGES))
CHAIN = block_hash_chain(PROMPT, 16, chain_root(MODEL))
PULLED = CHAIN[: (len(PROMPT) - 1) // 16]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **extra}


async def held(http: httpx.AsyncClient, url: str) -> set[int]:
    return set((await http.get(url + "/kv_blocks")).json()["block_hashes"])


async def decode_waits_at(p: EmulatorServer, room: int) -> None:
    """Until a decode side's pull of `room` waits at the prefill side `p` for its prefill (the
    order these tests pin down: the decode request first)."""
    assert p.app is not None
    holds = p.app.engine.holds
    # no public view of the waiting pulls: the holds' own table of them
    await until(lambda: f"room:{room}" in holds._waiters, what=f"a pull waiting at room {room}")


async def test_vllm_style_prefill_then_decode_moves_the_prefix(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    p = await start_emulator(role="prefill")
    d = await start_emulator(role="decode")
    pre = await http.post(
        p.url + "/v1/chat/completions",
        json=body(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}),
    )
    assert pre.status_code == 200, pre.text
    ktp = pre.json()["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["remote_port"] == p.config.port
    assert len(ktp["remote_block_ids"]) == len(PROMPT) // 16
    assert pre.json()["usage"]["completion_tokens"] == 1

    dec = await http.post(d.url + "/v1/chat/completions", json=body(kv_transfer_params=ktp))
    assert dec.status_code == 200, dec.text
    local = await http.post(d.url + "/v1/chat/completions", json=body(seed=None))
    assert dec.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
    assert set(PULLED) <= await held(http, d.url)

    d_metrics = await scrape(http, d)
    block_bytes = 16 * 131072
    received = "ownerserve_emulator_kv_received_bytes_total"
    assert metric_value(d_metrics, received, kind="pd") == len(PULLED) * block_bytes
    by_source = "vllm:prompt_tokens_by_source_total"
    assert metric_value(d_metrics, by_source, source="external_kv_transfer") == len(PULLED) * 16
    # Both the decode and the local repeat computed only the tail past the last full block.
    assert metric_value(d_metrics, "ownerserve_emulator_prefill_tokens_computed_total") == 2 * (
        len(PROMPT) - len(PULLED) * 16
    )
    p_metrics = await scrape(http, p)
    assert metric_value(p_metrics, "ownerserve_emulator_kv_sent_bytes_total", kind="pd") == (
        len(PULLED) * block_bytes
    )
    assert metric_value(p_metrics, "ownerserve_emulator_kv_transfers_held") == 0

    # The params were used up: a replay is stale and says so at once (the bound is on a hang:
    # a busy machine may take seconds).
    t0 = time.perf_counter()
    stale = await http.post(d.url + "/v1/chat/completions", json=body(kv_transfer_params=ktp))
    assert stale.status_code == 400
    assert "unknown or expired" in stale.json()["error"]["message"]
    assert time.perf_counter() - t0 < 10.0


async def test_decode_pulls_only_blocks_it_lacks(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    p = await start_emulator(role="prefill")
    d = await start_emulator(role="decode")
    half = [{"role": "user", "content": MESSAGES[0]["content"][:120]}]
    await http.post(d.url + "/v1/chat/completions", json={"messages": half, "max_tokens": 1})
    already = len(await held(http, d.url))
    pre = await http.post(
        p.url + "/v1/chat/completions", json=body(kv_transfer_params={"do_remote_decode": True})
    )
    ktp = pre.json()["kv_transfer_params"]
    dec = await http.post(d.url + "/v1/chat/completions", json=body(kv_transfer_params=ktp))
    assert dec.status_code == 200
    got = metric_value(await scrape(http, d), "ownerserve_emulator_kv_received_blocks_total")
    assert 0 < got <= len(PULLED) - already + 1


async def test_bad_transfer_params_are_clear_400s_not_hangs(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    d = await start_emulator(role="decode", transfer_timeout_s=0.5)
    cases = [
        {"do_remote_prefill": True},
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
         "remote_request_id": "gone"},
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": d.config.port,
         "remote_request_id": "never-prefilled"},
    ]  # fmt: skip
    for ktp in cases:
        t0 = time.perf_counter()
        resp = await http.post(d.url + "/v1/chat/completions", json=body(kv_transfer_params=ktp))
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert time.perf_counter() - t0 < 5.0
    room = await http.post(
        d.url + "/v1/chat/completions",
        json=body(bootstrap_host="127.0.0.1", bootstrap_port=d.config.port, bootstrap_room=42),
    )
    assert room.status_code == 400 and "bootstrap room 42" in room.json()["error"]["message"]
    assert metric_value(await scrape(http, d), "ownerserve_emulator_kv_blocks_in_use") == 0


async def test_sglang_style_same_body_to_both_sides_with_a_bootstrap_room(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    p = await start_emulator(role="prefill", bootstrap_port=0)
    d = await start_emulator(role="decode")
    assert p.config.bootstrap_port
    room = 1234567890123
    both = body(
        bootstrap_host="127.0.0.1", bootstrap_port=p.config.bootstrap_port, bootstrap_room=room
    )
    # The decode request may arrive first: it waits for the room.
    dec_task = asyncio.create_task(http.post(d.url + "/v1/chat/completions", json=both))
    await decode_waits_at(p, room)
    pre = await http.post(p.url + "/v1/chat/completions", json=both)
    dec = await dec_task
    assert pre.status_code == 200 and pre.json()["usage"]["completion_tokens"] == 1
    assert dec.status_code == 200, dec.text
    assert dec.json()["usage"]["completion_tokens"] == 12
    assert set(PULLED) <= await held(http, d.url)
    received = metric_value(
        await scrape(http, d), "ownerserve_emulator_kv_received_blocks_total", kind="pd"
    )
    assert received == len(PULLED)
    info = (await http.get(p.url + "/server_info")).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == p.config.bootstrap_port


async def test_sglang_streaming_decode(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    p = await start_emulator(role="prefill", bootstrap_port=0)
    d = await start_emulator(role="decode")
    both = body(
        stream=True,
        bootstrap_host="127.0.0.1",
        bootstrap_port=p.config.bootstrap_port,
        bootstrap_room=7,
    )

    async def read_stream(url: str) -> str:
        async with http.stream("POST", url + "/v1/chat/completions", json=both) as resp:
            assert resp.status_code == 200
            return (await resp.aread()).decode()

    dec_text, pre_text = await asyncio.gather(read_stream(d.url), read_stream(p.url))
    assert dec_text.endswith("data: [DONE]\n\n") and pre_text.endswith("data: [DONE]\n\n")
    assert dec_text.count('"finish_reason":"length"') == 1


async def test_artifact_fetch_copies_blocks_from_a_peer(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    src = await start_emulator(node="n1")
    dst = await start_emulator(node="n2")
    await http.post(src.url + "/v1/chat/completions", json=body(max_tokens=1))
    resp = await http.post(
        dst.url + "/ownerserve/kv/fetch",
        json={"source_url": src.url, "block_hashes": [*CHAIN, 99], "block_size": 16},
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["fetched"] == len(CHAIN) and out["missing"] == [99]
    assert out["blocks"] == len(CHAIN)  # the prefix it holds now: up to the missing block
    assert out["bytes"] == len(CHAIN) * 16 * 131072
    assert out["seconds"] > 0  # inter-node link
    assert set(CHAIN) <= await held(http, dst.url)
    warm = await http.post(dst.url + "/v1/chat/completions", json=body(max_tokens=1))
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PULLED) * 16
    again = await http.post(
        dst.url + "/ownerserve/fetch", json={"source_url": src.url, "block_hashes": CHAIN}
    )
    assert again.json()["already_held"] == len(CHAIN) and again.json()["bytes"] == 0
    assert again.json()["blocks"] == len(CHAIN)
    nowhere = {"source_url": "http://127.0.0.1:1", "block_hashes": [1]}
    bad = await http.post(dst.url + "/ownerserve/fetch", json=nowhere)
    assert bad.status_code == 502 and bad.json()["error"]["message"]


async def test_a_rejected_sglang_prefill_fails_its_waiting_decode_at_once(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    p = await start_emulator(role="prefill", bootstrap_port=0, max_model_len=64)
    d = await start_emulator(role="decode", transfer_timeout_s=20)
    both = body(bootstrap_host="127.0.0.1", bootstrap_port=p.config.bootstrap_port,
                bootstrap_room=99)  # fmt: skip
    dec_task = asyncio.create_task(http.post(d.url + "/v1/chat/completions", json=both))
    await decode_waits_at(p, 99)
    t0 = time.perf_counter()
    pre = await http.post(p.url + "/v1/chat/completions", json=both)
    assert pre.status_code == 400  # the prompt exceeds the prefill side's max_model_len
    dec = await dec_task
    assert dec.status_code == 400 and "rejected" in dec.json()["error"]["message"]
    assert time.perf_counter() - t0 < 10  # at once: not at the end of its 20 s wait


async def test_concurrent_fetches_share_the_inbound_link(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # 250 MB/s between nodes: one 16-block prompt (~34 MB) takes ~134 ms, four ~0.54 s.
    bps = 2.5e8
    profile = write_profile(tmp_path, link__inter_node_bps=bps)
    src = await start_emulator(node="n1", profile=profile)
    dst = await start_emulator(node="n2", profile=profile)
    chains = []
    for i in range(4):
        msgs = [{"role": "user", "content": f"{i} distinct context for fetching " * 8}]
        await http.post(src.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
        ids = ByteTokenizer().encode(ChatTemplate().render(msgs))
        chains.append(block_hash_chain(ids, 16, chain_root(MODEL)))

    async def fetch(chain: list[int]) -> dict[str, Any]:
        body = {"source_url": src.url, "block_hashes": chain}
        resp = await http.post(dst.url + "/ownerserve/kv/fetch", json=body)
        return dict(resp.json())

    results = await asyncio.gather(*(fetch(c) for c in chains))
    one = sum(r["bytes"] for r in results) / 4 / bps
    slowest = max(r["seconds"] for r in results)
    assert slowest > 3.5 * one  # the last one queued behind the other three
    metrics = await scrape(http, dst)
    queued = metric_value(metrics, "ownerserve_emulator_kv_link_queue_seconds_total")
    assert queued > 5 * one  # 1 + 2 + 3 transfer times of waiting
