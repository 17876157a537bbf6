"""Fixtures of the directory tests: each contract test runs on both backends (Redis twice:
sweeping by a full scan, as a namespace's first sweep does, and by expiry hints, as every
sweep does until the next daily full scan)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from ownerserve.directory import InMemoryDirectory
from ownerserve.directory.base import Directory
from ownerserve.directory.redis import RedisDirectory
from tests.conftest import RedisServer


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """A directory under test plus a way to let time pass for its leases and TTLs."""

    name: str
    directory: Directory
    advance: Callable[[float], Awaitable[None]]


@pytest.fixture(params=["memory", "redis", "redis-hints"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        clock = FakeClock()

        async def advance_clock(seconds: float) -> None:
            clock.now += seconds

        yield Backend("memory", InMemoryDirectory(clock=clock), advance_clock)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    directory = RedisDirectory.from_url(
        server.url, namespace=f"t-{uuid.uuid4().hex[:12]}", socket_timeout_s=10.0
    )
    if request.param == "redis-hints":  # as if a full scan had run: sweeps follow the hints
        await directory.client.set(directory.key("xidx"), "1")

    async def sleep(seconds: float) -> None:
        # Redis leases run on the server's clock: real time has to pass
        await asyncio.sleep(seconds)

    try:
        yield Backend("redis", directory, sleep)
    finally:
        await directory.flush_namespace()
        await directory.close()
