"""The bound on a view's copy of the workers' caches (`InMemoryDirectory(cached_limit=)`, the
local mirror of `ResilientDirectory`, `directory.mirror_cached_blocks`): past it the coldest
pairs go, the latest sessions' chains last, and routing from the mirror during a Redis outage
still finds those sessions' prefixes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError

from ownerserve.directory import InMemoryDirectory
from ownerserve.directory.base import CachedCounts
from ownerserve.directory.redis import RedisDirectory
from ownerserve.directory.resilient import ResilientDirectory
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from tests.conftest import RedisServer

BS = 4
ROOT = chain_root("mirror-bound-model")
SYSTEM = 4
"""Blocks of the system prompt every session starts with."""
OWN = 12
"""Blocks of each session's own turn after it."""


def tokens(session: int) -> list[int]:
    system = list(range(100, 100 + SYSTEM * BS))
    return system + [10_000 * (session + 1) + i for i in range(OWN * BS)]


def chain(session: int) -> tuple[int, ...]:
    return tuple(block_hash_chain(tokens(session), BS, ROOT))


def engine(worker: int, session: int, block: int) -> int:
    """A worker's engine hash of a session's block (the system prompt's are shared)."""
    if block < SYSTEM:
        return worker * 1_000_000 + block
    return worker * 1_000_000 + 1000 * (session + 1) + block


class Feed:
    """Stores sessions' blocks on workers as their KV events would, one batch a store."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.system_on: set[str] = set()

    def batch(self, worker: str, session: int) -> EventBatch:
        w = int(worker[1:])
        toks = tokens(session)
        events = []
        first = 0
        if worker not in self.system_on:
            self.system_on.add(worker)
            hashes = tuple(engine(w, session, b) for b in range(SYSTEM))
            events.append(BlockStored(hashes, None, tuple(toks[: SYSTEM * BS]), BS))
        first = SYSTEM
        hashes = tuple(engine(w, session, b) for b in range(first, SYSTEM + OWN))
        parent = engine(w, session, SYSTEM - 1)
        events.append(BlockStored(hashes, parent, tuple(toks[first * BS :]), BS))
        self.seq[worker] = self.seq.get(worker, 0) + 1
        return EventBatch(self.seq[worker], 0.0, tuple(events))


def gpu_counts(d: InMemoryDirectory) -> CachedCounts:
    """What `cached_counts` should say, recounted from the view's holders."""
    distinct = copies = 0
    for holders in d._cached.values():
        gpu = sum(1 for m in holders.values() if m & 1)
        copies += gpu
        distinct += gpu > 0
    return CachedCounts(distinct, copies)


async def two_workers_capped_at(limit: int) -> tuple[InMemoryDirectory, Feed]:
    """A view bounded to `limit` cached pairs with w1 and w2 registered, and their feed."""
    d = InMemoryDirectory(cached_limit=limit)
    for w in ("w1", "w2"):
        await d.register_worker(w, ROOT, BS)
    return d, Feed()


async def test_a_capped_view_evicts_the_oldest_stored_pairs() -> None:
    capped = InMemoryDirectory(cached_limit=64)
    unbounded = InMemoryDirectory()
    feed, same = Feed(), Feed()
    for d in (capped, unbounded):
        await d.register_worker("w1", ROOT, BS)
    for s in range(10):  # 16 pairs a session: 4 + 12 x 10 = 124 in all
        await capped.apply_events("w1", feed.batch("w1", s))
        await unbounded.apply_events("w1", same.batch("w1", s))
        assert capped.cached_pairs <= 64
        assert await capped.cached_counts() == gpu_counts(capped)
    assert unbounded.cached_pairs == SYSTEM + 10 * OWN and unbounded.evicted == 0
    assert capped.evicted > 0
    # no session was looked up: the oldest stored went first, the system prompt with them, so
    # every session misses from its first block on (and those stored after it went, on the
    # forgotten prompt, were skipped), never is credited a block it lost
    for s in range(10):
        assert (await capped.lookup(chain(s))).longest("w1", Tier.GPU) == 0
        assert (await unbounded.lookup(chain(s))).longest("w1", Tier.GPU) == SYSTEM + OWN
    health = await capped.health()
    assert health.stats["cached_pairs"] == capped.cached_pairs <= 64


async def test_the_latest_sessions_chains_are_spared_and_found_in_full() -> None:
    d, feed = await two_workers_capped_at(64)
    for s in range(12):
        worker = f"w{1 + s % 2}"
        d.note_chain(f"s{s}", chain(s))  # the router looks the chain up, then routes it
        await d.apply_events(worker, feed.batch(worker, s))
        assert d.cached_pairs <= 64
        assert await d.cached_counts() == gpu_counts(d)
    assert d.evicted > 0
    # the two latest sessions, one a worker: their whole prefix, the system prompt stored
    # first of all included
    for s in (10, 11):
        m = await d.lookup(chain(s), f"s{s}")
        assert m.longest(f"w{1 + s % 2}", Tier.GPU) == SYSTEM + OWN
    # the oldest sessions' own blocks went (each worker's oldest stored), the shared prompt
    # stayed: a lookup of theirs finds it alone
    for s in (0, 1):
        assert (await d.lookup(chain(s))).longest(f"w{1 + s % 2}", Tier.GPU) == SYSTEM


async def test_a_worker_dropped_from_a_capped_view_frees_its_pairs() -> None:
    d, feed = await two_workers_capped_at(64)
    for s in range(6):
        worker = f"w{1 + s % 2}"
        await d.apply_events(worker, feed.batch(worker, s))
    kept = d.cached_pairs
    await d.drop_worker("w1")
    assert 0 < d.cached_pairs == len(d._workers["w2"].engine_map) < kept
    assert await d.cached_counts() == gpu_counts(d)


async def test_routing_from_a_capped_mirror_during_an_outage_finds_the_latest_sessions(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory()
    primary = RedisDirectory.from_url(server.url, "mb", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05, mirror_cached_blocks=64)
    feed = Feed()
    try:
        for w in ("w1", "w2"):
            await d.register_worker(w, ROOT, BS)
        for s in range(12):
            worker = f"w{1 + s % 2}"
            await d.lookup(chain(s), f"s{s}")
            await d.apply_events(worker, feed.batch(worker, s))
        health = await d.health()
        assert health.healthy
        assert 0 < health.stats["mirror_cached_pairs"] <= 64
        assert health.stats["mirror_evicted"] > 0
        # Redis keeps every pair; the mirror only its bound
        redis_pairs = (await d.cached_counts()).copies
        assert redis_pairs == 2 * SYSTEM + 12 * OWN
        with contextlib.suppress(RedisConnectionError):
            await primary.client.shutdown(save=True)  # comes back with its data
        server.stop()
        for s in (10, 11):
            m = await d.lookup(chain(s), f"s{s}")
            assert m.longest(f"w{1 + s % 2}", Tier.GPU) == SYSTEM + OWN
        assert not d.healthy
        assert (await d.lookup(chain(0))).longest("w1", Tier.GPU) == SYSTEM
        server.start()
        assert await d.wait_reconciled(10)
        # back on Redis: the oldest session's whole prefix again
        assert (await d.lookup(chain(0))).longest("w1", Tier.GPU) == SYSTEM + OWN
    finally:
        await d.close()
