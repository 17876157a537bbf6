"""Prefix caching through the HTTP API: hits show in usage, metrics and time; eviction under
capacity pressure; the held-blocks listing agrees with the router's hash chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
from tests.workers.emulator.conftest import (
    StartEmulator,
    metric_value,
    scrape,
    timed_post,
    write_profile,
)
from workers.emulator.config import DEFAULT_MODEL as MODEL


def chat_body(content: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


async def timed_chat(
    http: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    return await timed_post(http, url + "/v1/chat/completions", body)


async def test_repeated_prompt_hits_the_cache_in_usage_metrics_and_time(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # 2 ms per prefill token: a 400-token prompt costs ~0.8 s cold, ~nothing warm.
    server = await start_emulator(profile=write_profile(tmp_path, prefill__per_token_s=2e-3))
    prompt = "a fairly long shared system prompt for an agent " * 8
    cold, cold_s = await timed_chat(http, server.url, chat_body(prompt, max_tokens=1))
    warm, warm_s = await timed_chat(http, server.url, chat_body(prompt, max_tokens=1))
    n = cold["usage"]["prompt_tokens"]
    assert n > 350
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 16 * 16
    assert cold_s > 0.7
    assert warm_s < cold_s / 3
    text = await scrape(http, server)
    assert metric_value(text, "vllm:prefix_cache_queries_total") == 2 * n
    assert metric_value(text, "vllm:prefix_cache_hits_total") == cached
    by_source = "vllm:prompt_tokens_by_source_total"
    assert metric_value(text, by_source, source="local_cache_hit") == cached
    assert metric_value(text, by_source, source="local_compute") == 2 * n - cached
    assert metric_value(text, "ownerserve_emulator_prefill_tokens_computed_total") == 2 * n - cached


async def test_held_blocks_are_the_router_hash_chain_of_the_prompt(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(salt="s1")
    body = chat_body("hello world, the block boundaries must agree " * 3, max_tokens=1)
    await timed_chat(http, server.url, body)
    tokens = ByteTokenizer().encode(ChatTemplate().render(body["messages"]))
    expected = block_hash_chain(tokens, 16, chain_root(MODEL, "s1"))
    listing = (await http.get(server.url + "/kv_blocks")).json()
    assert listing["block_size"] == 16
    assert set(expected) <= set(listing["block_hashes"])
    assert listing["blocks_held"] == len(listing["block_hashes"])
    tok = (await http.post(server.url + "/tokenize", json={"messages": body["messages"]})).json()
    assert tok["tokens"] == tokens and tok["count"] == len(tokens)


async def test_eviction_under_capacity_pressure_drops_the_oldest_prefix(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator(num_blocks=24)
    prompts = [f"{i}: prompt " + "x" * 150 for i in range(4)]  # ~11 blocks, none shared
    for p in prompts:
        await timed_chat(http, server.url, chat_body(p, max_tokens=2))
    text = await scrape(http, server)
    assert metric_value(text, "ownerserve_emulator_kv_blocks_evicted_total") > 0
    assert metric_value(text, "ownerserve_emulator_kv_blocks_held") <= 24
    last, _ = await timed_chat(http, server.url, chat_body(prompts[-1], max_tokens=1))
    first, _ = await timed_chat(http, server.url, chat_body(prompts[0], max_tokens=1))
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_concurrent_requests_beyond_capacity_all_complete_via_preemption(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    import asyncio

    server = await start_emulator(num_blocks=12)
    bodies = [chat_body(f"request {i} " + "y" * 40, max_tokens=60) for i in range(6)]
    results = await asyncio.gather(*(timed_chat(http, server.url, b) for b in bodies))
    assert all(r["choices"][0]["finish_reason"] == "length" for r, _ in results)
    text = await scrape(http, server)
    assert metric_value(text, "vllm:num_preemptions_total") > 0
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "ownerserve_emulator_kv_blocks_in_use") == 0
