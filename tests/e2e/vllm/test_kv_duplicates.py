"""The HBM duplicate factor the router exports (`ownerserve_kv_block_copies /
ownerserve_kv_blocks_distinct`, from real vLLM CPU workers' own KV events) follows a forced
duplication, the same prompt prefilled on both workers, and its eviction from one of them."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from ownerserve.directory.base import CachedCounts
from ownerserve.hashing import block_hash_chain, chain_root
from tests.e2e.router_cluster import metric_value, proxy_client
from tests.e2e.vllm.conftest import (
    BLOCK,
    HYBRID_KV_BLOCKS,
    until,
    vllm_client,
    vllm_router_settings,
    vllm_worker,
)
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1800) for _ in range(n)]


def _excess(c: CachedCounts) -> int:
    """GPU copies beyond one per distinct block."""
    return c.copies - c.distinct


async def test_the_duplicate_factor_follows_a_forced_duplication_and_its_eviction(
    vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer, vllm_hybrid_b: VllmServer
) -> None:
    settings = vllm_router_settings(
        vllm_install, [vllm_worker("a", vllm_hybrid), vllm_worker("b", vllm_hybrid_b)]
    )
    a, b = vllm_client("a", vllm_hybrid.url), vllm_client("b", vllm_hybrid_b.url)
    blocks = 12
    prompt = _tokens(7001, blocks * BLOCK + 5)  # 12 full blocks, new to both workers
    chain = block_hash_chain(prompt, BLOCK, chain_root(SERVED_NAME))
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}
    seen: dict[str, Any] = {}
    try:
        async with proxy_client(settings) as (client, router):
            client.timeout = httpx.Timeout(300.0)
            directory = router.directory
            assert directory is not None

            async def holds(worker: str, n: int) -> bool:
                return (await directory.lookup(chain)).longest(worker) == n

            await a.post("/v1/completions", body)
            await until(lambda: holds("a", blocks))
            seen["a"] = once = await directory.cached_counts()
            # the same prompt prefilled on b too: each of its blocks twice
            await b.post("/v1/completions", body)
            await until(lambda: holds("b", blocks))
            seen["a+b"] = twice = await directory.cached_counts()
            assert twice.copies - once.copies == blocks and twice.distinct == once.distinct
            assert twice.copies / twice.distinct > once.copies / once.distinct

            async def exported() -> bool:  # what /metrics says, read every health interval
                text = (await client.get("/metrics")).text
                now = await directory.cached_counts()
                return (
                    metric_value(text, "ownerserve_kv_block_copies", tier="gpu") == now.copies
                    and metric_value(text, "ownerserve_kv_blocks_distinct", tier="gpu")
                    == now.distinct
                )

            await until(exported)

            # a's small cache filled with other prompts, more than it holds: vLLM evicts the
            # shared blocks there (the oldest), b keeps its copy
            filler = 30 * BLOCK
            for seed in range(7200, 7200 + HYBRID_KV_BLOCKS // 30 + 2):
                await a.post("/v1/completions", {**body, "prompt": _tokens(seed, filler)})
            await until(lambda: holds("a", 0))
            assert await holds("b", blocks)
            seen["evicted"] = left = await directory.cached_counts()
            assert _excess(left) <= _excess(twice) - blocks
            assert left.copies / left.distinct < twice.copies / twice.distinct
            await until(exported)
    finally:
        print(f"\ncached counts: {seen}")
        await a.aclose()
        await b.aclose()
