"""Real vLLM KV events into the real directory: stores become ownership the router can look
up by its own block hashes, and evictions take it away again."""

from __future__ import annotations

import random

import pytest

from ownerserve.directory.base import EventApplyResult
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.events import BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from router.backends.kv_events import subscriber_for_source
from tests.e2e.vllm.conftest import HYBRID_KV_BLOCKS, until, vllm_client
from workers.vllm_cpu.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
BLOCK = 32


class RecordingDirectory:
    """The in-process directory, plus a record of every batch it was given."""

    def __init__(self) -> None:
        self.directory = InMemoryDirectory()
        self.batches: list[EventBatch] = []
        self.drops = 0

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        self.batches.append(batch)
        return await self.directory.apply_events(worker, batch)

    async def drop_worker(self, worker: str) -> int:
        self.drops += 1
        return await self.directory.drop_worker(worker)

    def events(self) -> list[BlockStored | BlockRemoved]:
        return [
            e for b in self.batches for e in b.events if isinstance(e, BlockStored | BlockRemoved)
        ]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1800) for _ in range(n)]


async def test_stored_blocks_become_directory_holdings_and_evictions_remove_them(
    vllm_hybrid: VllmServer,
) -> None:
    client = vllm_client("hybrid", vllm_hybrid.url)
    sink = RecordingDirectory()
    root = chain_root(MODEL)
    await sink.directory.register_worker("hybrid", root, BLOCK)
    sources = await client.kv_event_sources()
    sub = subscriber_for_source("hybrid", sources[0], sink)
    await sub.start()
    try:
        prompt = _tokens(1, 100)
        chain = block_hash_chain(prompt, BLOCK, root)
        assert len(chain) == 3
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        await client.post("/v1/completions", body)

        async def held() -> bool:
            match = await sink.directory.lookup(chain)
            return match.longest("hybrid") == 3

        await until(held)
        stored = [e for e in sink.events() if isinstance(e, BlockStored)]
        ours = [e for e in stored if e.token_ids[:BLOCK] == tuple(prompt[:BLOCK])]
        assert ours and ours[0].parent_engine_hash is None
        assert ours[0].block_size == BLOCK
        assert ours[0].token_ids == tuple(prompt[: BLOCK * len(ours[0].engine_hashes)])

        # Fill the small KV cache with other prompts until vLLM evicts the first one.
        evict_len = 30 * BLOCK
        for seed in range(2, 2 + HYBRID_KV_BLOCKS // 30 + 2):
            filler = {**body, "prompt": _tokens(seed, evict_len)}
            await client.post("/v1/completions", filler)

        async def evicted() -> bool:
            match = await sink.directory.lookup(chain)
            return match.longest("hybrid") < 3

        await until(evicted)
        assert any(isinstance(e, BlockRemoved) for e in sink.events())
        assert sub.stats.malformed == 0
    finally:
        await sub.close()
        await client.aclose()
