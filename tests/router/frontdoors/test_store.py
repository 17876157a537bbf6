"""The Responses stores: the in-process one (TTL, byte bound) and the Redis one (a real
redis-server, TTL)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ownerserve.config import settings_from_dict
from router.frontdoors.responses import Conversation
from router.frontdoors.store import (
    InMemoryConversationStore,
    RedisConversationStore,
    open_store,
)
from tests.waiting import until


def conv(n: int) -> Conversation:
    return Conversation("c", ({"role": "user", "content": "x" * n},), {"id": "r"})


async def test_in_memory_store_drops_least_recently_used_beyond_its_bytes():
    size = len(conv(100).to_bytes())
    store = InMemoryConversationStore(ttl_s=60, max_bytes=2 * size)
    await store.put("a", conv(100))
    await store.put("b", conv(100))
    assert await store.get("a") == conv(100)  # a is now the most recently used
    await store.put("c", conv(100))
    assert await store.get("b") is None and await store.get("a") is not None
    assert store.bytes == 2 * size
    assert await store.delete("a") and not await store.delete("a")
    assert store.bytes == size


async def test_in_memory_store_forgets_after_its_ttl():
    store = InMemoryConversationStore(ttl_s=0.05, max_bytes=1 << 20)
    await store.put("a", conv(1))
    await asyncio.sleep(0.1)
    assert await store.get("a") is None and store.bytes == 0


async def _gone(store: RedisConversationStore, response_id: str) -> bool:
    return await store.get(response_id) is None


@pytest.mark.redis
async def test_redis_store_shares_responses_and_expires_them(redis_server):
    prefix = f"st-{uuid.uuid4().hex[:8]}"
    # the TTL runs in Redis, in real time: long enough to read the entry back on a busy
    # machine, short enough to wait out
    one = RedisConversationStore.from_url(redis_server.url, prefix, ttl_s=1.0)
    two = RedisConversationStore.from_url(redis_server.url, prefix, ttl_s=1.0)
    try:
        await one.put("r1", conv(10))
        assert await two.get("r1") == conv(10)
        await until(lambda: _gone(two, "r1"), what="r1 expired")
        await one.put("r2", conv(10))
        assert await two.delete("r2") and await one.get("r2") is None
    finally:
        await one.close()
        await two.close()


def test_open_store_follows_the_directory_backend():
    memory = settings_from_dict({"responses": {"memory_max_bytes": 1000}})
    store = open_store(memory)
    assert isinstance(store, InMemoryConversationStore) and store.max_bytes == 1000
    redis = settings_from_dict(
        {"directory": {"backend": "redis", "redis_url": "redis://127.0.0.1:1/0"}}
    )
    assert isinstance(open_store(redis), RedisConversationStore)
