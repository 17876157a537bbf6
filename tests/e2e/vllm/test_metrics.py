"""Scraping a real vLLM's `/metrics` into load and cache usage."""

from __future__ import annotations

import pytest

from router.backends.vllm import VllmClient
from tests.e2e.vllm.conftest import vllm_client
from workers.vllm_cpu.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


async def test_a_repeated_prompt_shows_up_as_prefix_cache_hits(vllm_hybrid: VllmServer) -> None:
    client = vllm_client("hybrid", vllm_hybrid.url)
    try:
        assert await client.health()
        prompt = " ".join(f"metrics probe {i} sit amet" for i in range(40))
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        first = await client.post("/v1/completions", body)
        before = await client.load()
        await client.post("/v1/completions", body)
        after = await client.load()
        prompt_tokens = first["usage"]["prompt_tokens"]
        full_blocks = prompt_tokens // 32 * 32
        assert prompt_tokens > 64
        assert after.prefix_cache_queries - before.prefix_cache_queries == prompt_tokens
        assert after.prefix_cache_hits - before.prefix_cache_hits >= full_blocks - 32
        hit = "local_cache_hit"
        assert (
            after.prompt_tokens_by_source[hit] - before.prompt_tokens_by_source[hit]
            >= full_blocks - 32
        )
        assert after.num_requests_running == 0 and after.num_requests_waiting == 0
        assert 0.0 <= after.kv_cache_usage_perc <= 1.0
    finally:
        await client.aclose()


async def test_health_is_false_for_a_port_nobody_serves() -> None:
    from ownerserve.ports import free_port

    client = VllmClient("nobody", f"http://127.0.0.1:{free_port()}")
    try:
        assert not await client.health()
    finally:
        await client.aclose()
