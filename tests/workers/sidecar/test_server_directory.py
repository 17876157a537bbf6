"""Sidecars publish the blocks they hold to a real Redis directory as replicas of their worker
(tier `cpu` for memory, `ssd` for files), and the router's view of that directory sees them; a
sidecar that stops renewing drops out of lookups within its TTL, and one restarted on the same
store directory publishes and serves its SSD tier again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ownerserve.directory import HoldKind, Match
from ownerserve.directory.redis import RedisDirectory
from ownerserve.types import Tier
from tests.conftest import RedisServer
from tests.workers.sidecar.test_server import fetch_body, keys_of, payload, put_chunks, sidecar

pytestmark = pytest.mark.redis

CHAIN = [0x1001, 0x1002, 0x1003, 0x1004]


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.05)
    return await cond()


def replica_blocks(match: Match, worker: str, tier: Tier) -> int:
    return max(
        (
            h.blocks
            for h in match.holdings
            if h.worker == worker and h.tier == tier and h.kind is HoldKind.REPLICA
        ),
        default=0,
    )


async def test_stored_and_fetched_blocks_show_up_as_replicas_and_expire(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    prefix = f"sc-{uuid.uuid4().hex[:8]}"
    shared: dict[str, Any] = {
        "directory": redis_server.url,
        "directory_prefix": prefix,
        "replica_ttl_s": 1.5,
    }
    router_view = RedisDirectory.from_url(redis_server.url, prefix)
    try:
        async with (
            sidecar(tmp_path, "a", **shared) as a,
            httpx.AsyncClient() as http,
        ):
            await put_chunks(http, a, CHAIN[:3])

            async def a_published() -> bool:
                m = await router_view.lookup(CHAIN)
                return replica_blocks(m, "a", Tier.CPU) == 3

            assert await until(a_published)

            async with sidecar(tmp_path, "b", memory_bytes=0, **shared) as b:
                r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, CHAIN))
                assert r.json()["blocks"] == 3

                async def b_published() -> bool:
                    m = await router_view.lookup(CHAIN)
                    return replica_blocks(m, "b", Tier.SSD) == 3

                assert await until(b_published)
                # renewed past several TTLs while the sidecar lives
                await asyncio.sleep(2.5)
                match = await router_view.lookup(CHAIN)
                assert replica_blocks(match, "a", Tier.CPU) == 3
                assert replica_blocks(match, "b", Tier.SSD) == 3

            async def b_gone() -> bool:
                m = await router_view.lookup(CHAIN)
                return (
                    replica_blocks(m, "b", Tier.SSD) == 0 and replica_blocks(m, "a", Tier.CPU) == 3
                )

            assert await until(b_gone, timeout_s=5.0)

            # b restarts on the same store directory: its SSD tier is back, published and served
            async with sidecar(tmp_path, "b", memory_bytes=0, **shared) as b:
                assert await until(b_published)
                key = keys_of(CHAIN[2])[1]
                r = await http.get(f"{b.url}/ownerserve/kv/artifacts/{key}")
                assert r.status_code == 200 and r.content == payload(key)
            async with sidecar(tmp_path, "b", memory_bytes=0, clear_ssd=True, **shared) as b:
                r = await http.post(f"{b.url}/ownerserve/kv/lookup", json={"keys": [key]})
                assert r.json() == {"present": [False]}
    finally:
        await router_view.close()
