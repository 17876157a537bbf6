"""What only the Redis backend does: batched reuse counts, the worker-name map, script reloads."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from ownerserve.directory import redis as redis_backend
from ownerserve.directory.base import Artifact, Holding, HoldKind
from ownerserve.directory.redis import RedisDirectory
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from tests.conftest import RedisServer

BS = 4
ROOT = chain_root("redis-backend")
TOKENS = list(range(16 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[tuple[RedisDirectory, RedisDirectory]]:
    ns = f"rb-{uuid.uuid4().hex[:8]}"
    a = RedisDirectory.from_url(redis_server.url, ns, socket_timeout_s=10)
    b = RedisDirectory.from_url(redis_server.url, ns, socket_timeout_s=10)
    yield a, b
    await a.flush_namespace()
    await a.close()
    await b.close()


async def test_reuse_counts_are_sent_in_the_background(
    pair: tuple[RedisDirectory, RedisDirectory], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    monkeypatch.setattr(redis_backend, "TOUCH_FLUSH_S", 0.05)
    await a.claim(Artifact(CHAIN[:4]), "w1", 60)
    await a.claim(Artifact(CHAIN[:8], start=4), "w1", 60)
    for _ in range(3):
        await a.lookup(CHAIN[:8])
    await asyncio.sleep(0.1)
    await a.lookup(CHAIN[:2])  # past the deadline: this one triggers the send
    for _ in range(100):
        if await a.client.hget(a.key("reuse"), format(CHAIN[3], "016x")) == "4":
            break
        await asyncio.sleep(0.01)
    assert await a.client.hget(a.key("reuse"), format(CHAIN[3], "016x")) == "4"
    assert await a.client.hget(a.key("reuse"), format(CHAIN[7], "016x")) == "3"


async def test_workers_registered_by_another_router_appear_by_name(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    a, b = pair
    await a.lookup(CHAIN[:4])  # a has read the (empty) name map
    await b.register_worker("w-from-b", ROOT, BS)
    stored = BlockStored((1, 2, 3), None, tuple(TOKENS[: 3 * BS]), BS)
    await b.apply_events("w-from-b", EventBatch(1, 0.0, (stored,)))
    m = await a.lookup(CHAIN[:4])
    assert m.holdings == (Holding("w-from-b", Tier.GPU, 3, HoldKind.CACHED),)


async def test_scripts_are_reloaded_after_a_script_flush(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    a, _ = pair
    lease = await a.claim(Artifact(CHAIN[:4]), "w1", 60)
    await a.client.script_flush()
    assert (await a.lookup(CHAIN[:4])).owner_epoch == lease.epoch
