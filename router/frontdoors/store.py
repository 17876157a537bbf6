"""Where the Responses API keeps stored responses (`Conversation`s) between turns: in-process
by default, in Redis when the directory is (so every router replica continues every
conversation). Both forget a response `responses.ttl_s` after it was stored."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ownerserve.config import Settings
from ownerserve.directory.redis import split_cluster_flag
from router.frontdoors.responses import Conversation


class ConversationStore(Protocol):
    """Stored responses by id."""

    async def get(self, response_id: str) -> Conversation | None:
        """The stored response, or None (never stored, deleted or expired)."""
        ...

    async def put(self, response_id: str, conversation: Conversation) -> None: ...

    async def delete(self, response_id: str) -> bool:
        """Forget the response; False if there was none."""
        ...

    async def close(self) -> None: ...


class InMemoryConversationStore:
    """One router's store: least recently used responses dropped beyond `max_bytes`."""

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def get(self, response_id: str) -> Conversation | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            await self.delete(response_id)
            return None
        self._entries.move_to_end(response_id)
        return Conversation.from_bytes(entry[1])

    async def put(self, response_id: str, conversation: Conversation) -> None:
        raw = conversation.to_bytes()
        await self.delete(response_id)
        self._entries[response_id] = (time.monotonic() + self.ttl_s, raw)
        self.bytes += len(raw)
        while self.bytes > self.max_bytes and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= len(dropped)

    async def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= len(entry[1])
        return True

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0


class RedisConversationStore:
    """The store of every router replica sharing one Redis: a string per response,
    `{prefix}:resp:{id}`, with a TTL (one round trip per operation)."""

    def __init__(self, client: aioredis.Redis | RedisCluster, prefix: str, ttl_s: float) -> None:
        self._client = client
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))

    @classmethod
    def from_url(cls, url: str, prefix: str, ttl_s: float) -> RedisConversationStore:
        plain, cluster = split_cluster_flag(url)
        client: aioredis.Redis | RedisCluster
        if cluster:
            client = RedisCluster.from_url(plain, socket_timeout=2.0)
        else:
            client = aioredis.Redis.from_url(plain, socket_timeout=2.0)
        return cls(client, prefix, ttl_s)

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    async def get(self, response_id: str) -> Conversation | None:
        raw = await self._client.get(self.key(response_id))
        if raw is None:
            return None
        return Conversation.from_bytes(raw if isinstance(raw, bytes) else raw.encode())

    async def put(self, response_id: str, conversation: Conversation) -> None:
        await self._client.set(self.key(response_id), conversation.to_bytes(), px=self.ttl_ms)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._client.delete(self.key(response_id)))

    async def close(self) -> None:
        await self._client.aclose()


def open_store(settings: Settings) -> ConversationStore:
    """The store beside the directory `settings` name: Redis when it is, else in-process."""
    r = settings.responses
    d = settings.directory
    if d.backend == "redis" and d.redis_url:
        return RedisConversationStore.from_url(d.redis_url, d.key_prefix, r.ttl_s)
    return InMemoryConversationStore(r.ttl_s, r.memory_max_bytes)
