"""Redis stopped mid-run and restarted: through `ResilientDirectory` no call fails, and the
state reconciles, both when Redis comes back with its data and when it lost it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from ownerserve.config import DirectorySettings
from ownerserve.directory import InMemoryDirectory, open_directory
from ownerserve.directory.base import Artifact, CachedCounts, Holding, HoldKind
from ownerserve.directory.redis import RedisDirectory, split_cluster_flag
from ownerserve.directory.resilient import PROVISIONAL_EPOCH_BASE, ResilientDirectory
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tasks import wait_ended
from ownerserve.types import Tier
from tests.conftest import RedisServer
from tests.waiting import until

BS = 4
ROOT = chain_root("resilient-model")
TOKENS = list(range(500, 500 + 32 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))


def stored(first: int, n: int, parent: int | None) -> BlockStored:
    engine = tuple(7000 + i for i in range(first, first + n))
    return BlockStored(engine, parent, tuple(TOKENS[first * BS : (first + n) * BS]), BS)


@pytest.fixture
async def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory()


@pytest.fixture
async def resilient(server: RedisServer) -> AsyncIterator[ResilientDirectory]:
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05)
    yield d
    await d.close()


async def fresh_view(server: RedisServer) -> RedisDirectory:
    return RedisDirectory.from_url(server.url, "rs", socket_timeout_s=5.0)


async def populate(d: ResilientDirectory) -> tuple[int, int]:
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events("w1", EventBatch(1, 0.0, (stored(0, 4, None),)))
    lease = await d.claim(Artifact(CHAIN[:8]), "w1", 60.0)
    await d.set_session_owner("s1", "w1", 60.0)
    await d.add_replica(CHAIN[7], "w3", Tier.CPU, 60.0)
    await d.add_fork_ref(CHAIN[7], "branch-1")
    return lease.artifact_id, lease.epoch


async def during_outage(d: ResilientDirectory) -> int:
    """Serve from the local view; returns the provisional epoch of a claim made meanwhile."""
    m = await d.lookup(CHAIN[:16], "s1")
    assert (m.owner, m.owner_blocks, m.session_owner) == ("w1", 8, "w1")
    assert m.longest("w1", Tier.GPU) == 8 and m.longest("w3", Tier.CPU) == 8
    delta = await d.claim(Artifact(CHAIN[:16], start=8), "w2", 60.0)
    assert delta.worker == "w2" and delta.epoch >= PROVISIONAL_EPOCH_BASE
    await d.set_session_owner("s2", "w2", 60.0)
    r = await d.apply_events("w1", EventBatch(2, 0.0, (stored(4, 2, 7003),)))
    assert r.stored == 2
    assert (await d.lookup(CHAIN[:16])).holdings[-1] == Holding("w1", Tier.GPU, 6, HoldKind.CACHED)
    assert await d.cached_counts() == CachedCounts(6, 6)  # the local view's
    h = await d.health()
    assert not h.healthy and h.pending_reconcile == 3
    return delta.epoch


async def through_an_outage(
    server: RedisServer, d: ResilientDirectory, *, keep_data: bool
) -> tuple[int, int, int]:
    """`populate` `d`, stop Redis (saving its dataset first when `keep_data`; without
    persistence it is gone), serve `during_outage`, restart it and wait until `d` has
    reconciled: (the populated artifact id, its epoch, the outage claim's provisional epoch)."""
    aid, epoch = await populate(d)
    if keep_data:
        with contextlib.suppress(RedisConnectionError):
            await d.primary.client.shutdown(save=True)  # keeps dump.rdb: comes back with its data
    server.stop()
    provisional = await during_outage(d)
    server.start()
    assert await d.wait_reconciled(10)
    return aid, epoch, provisional


async def check_reconciled(server: RedisServer, lease: tuple[int, int]) -> None:
    view = await fresh_view(server)
    try:
        m = await view.lookup(CHAIN[:16], "s1")
        assert [(h.worker, h.tier, h.blocks, h.kind.value) for h in m.holdings] == [
            ("w1", Tier.GPU, 8, "owner"),
            ("w2", Tier.GPU, 16, "owner"),
            ("w3", Tier.CPU, 8, "replica"),
            ("w1", Tier.GPU, 6, "cached"),
        ]
        assert await view.cached_counts() == CachedCounts(6, 6)  # restored or replayed
        assert (m.owner, m.session_owner) == ("w2", "w1")
        assert m.owner_epoch < PROVISIONAL_EPOCH_BASE
        assert await view.get_session_owner("s2") == "w2"
        info = await view.artifact_info(CHAIN[7])
        assert info is not None and info.fork_refs == 1 and info.worker == "w1"
        assert info.epoch >= lease[1]
    finally:
        await view.close()


async def test_outage_with_data_loss_pushes_the_local_view_back(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    aid, epoch, provisional = await through_an_outage(server, d, keep_data=False)
    assert d.stats["resyncs"] == 1 and d.pending == 0
    await check_reconciled(server, (aid, epoch))
    view = await fresh_view(server)
    try:
        info = await view.artifact_info(CHAIN[7])
        assert info is not None and info.epoch > epoch  # epochs never repeat after the loss
    finally:
        await view.close()
    # callers still holding old or provisional epochs keep working (translated)
    assert (await d.renew(aid, "w1", epoch, 60.0)).worker == "w1"
    assert (await d.renew(CHAIN[15], "w2", provisional, 60.0)).worker == "w2"
    assert (await d.health()).healthy


async def test_outage_without_data_loss_replays_the_queued_writes(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    aid, epoch, provisional = await through_an_outage(server, d, keep_data=True)
    assert (d.stats["resyncs"], d.stats["replayed"], d.pending) == (0, 3, 0)
    await check_reconciled(server, (aid, epoch))
    renewed = await d.renew(CHAIN[15], "w2", provisional, 60.0)
    assert renewed.epoch < PROVISIONAL_EPOCH_BASE


async def test_a_provisional_claim_that_lost_on_replay_is_fenced(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    await d.register_worker("w1", ROOT, BS)
    server.stop()
    provisional = await d.claim(Artifact(CHAIN[:8]), "w1", 60.0)
    d.retry_interval_s = 0.5  # time for another router to claim first once Redis is back
    server.start()
    other = await fresh_view(server)
    try:
        winner = await other.claim(Artifact(CHAIN[:8]), "w9", 60.0)
        assert await d.wait_reconciled(10)
        assert d.stats["conflicts"] == 1
        m = await d.lookup(CHAIN[:8])
        assert (m.owner, m.owner_epoch) == ("w9", winner.epoch)
        with pytest.raises(StaleEpochError):
            await d.renew(CHAIN[7], "w1", provisional.epoch, 60.0)
    finally:
        await other.close()


async def test_a_batch_queued_in_an_outage_is_refused_on_replay_once_its_life_was_dropped(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    # the worker dies while this router cannot reach Redis; another router, which can, drops
    # it: the batch this router queued from before the death must not bring its blocks back
    d = resilient
    await d.register_worker("w1", ROOT, BS)
    life = await d.worker_life("w1")
    d.retry_interval_s = 3600.0  # the replay below runs by hand, after the other's drop
    with contextlib.suppress(RedisConnectionError):
        await d.primary.client.shutdown(save=True)  # keeps dump.rdb: comes back with its data
    server.stop()
    assert (await d.apply_events("w1", EventBatch(1, 0.0, (stored(0, 4, None),)), life)).stored
    assert d.pending == 1
    server.start()
    other = await fresh_view(server)
    try:
        await other.drop_worker("w1", life)
        await d._reconcile()
        assert d.pending == 0 and (await d.health()).healthy
        assert (await other.lookup(CHAIN[:4])).holdings == ()
    finally:
        await other.close()


async def queued_in_an_outage(d: ResilientDirectory, server: RedisServer, n: int) -> None:
    """Register a worker, stop Redis (its dataset saved), queue `n` session writes in the
    outage, and start Redis again (the replay is `d`'s to run)."""
    await d.register_worker("w1", ROOT, BS)
    with contextlib.suppress(RedisConnectionError):
        await d.primary.client.shutdown(save=True)
    server.stop()
    for i in range(n):
        await d.set_session_owner(f"queued-{i}", "w1", 60.0)
    server.start()


async def test_writes_coming_on_during_the_replay_do_not_keep_redis_out_of_reach(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    # a router under load writes all the time; the replay of what it queued is one round trip
    # a write: if new writes kept queueing at the local view's speed, the replay never ends
    d = resilient
    d.retry_interval_s = 3600.0  # the replay below runs by hand, the writer beside it
    await queued_in_an_outage(d, server, 200)
    assert d.pending == 200
    written = 0
    stop = asyncio.Event()

    async def keep_writing() -> None:
        # stopped by a flag: a cancel can be lost in redis-py (Python 3.11's `wait_for`
        # returns its inner result when the cancel lands as the send ends)
        nonlocal written
        while not stop.is_set():
            await d.set_session_owner(f"live-{written}", "w1", 60.0)
            written += 1
            await asyncio.sleep(0)  # as requests do between their writes: others run

    writer = asyncio.create_task(keep_writing())  # runs from the replay's first round trip
    try:
        async with asyncio.timeout(60):
            await d._reconcile()
        assert d.healthy and d.pending == 0
        await until(lambda: written > 10, what="writes going on, to Redis now")
    finally:
        stop.set()
        assert await wait_ended([writer], 30.0), "the writer stops at its flag"
    assert d.healthy and d.pending == 0
    view = await fresh_view(server)
    try:
        assert await view.get_session_owner("queued-199") == "w1"
        assert await view.get_session_owner(f"live-{written - 1}") == "w1"
    finally:
        await view.close()


async def test_no_call_fails_while_redis_goes_away_and_comes_back(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    await d.register_worker("w1", ROOT, BS)
    failures: list[BaseException] = []
    done = 0
    stop = asyncio.Event()

    async def router_loop(k: int) -> None:
        nonlocal done
        i = 0
        while not stop.is_set():
            i += 1
            try:
                n = 1 + (i + k) % 30
                await d.lookup(CHAIN[:n], f"s{k}")
                lease = await d.claim(Artifact(CHAIN[:n]), f"w{k}", 30.0)
                if lease.worker == f"w{k}":
                    await d.renew(lease.artifact_id, lease.worker, lease.epoch, 30.0)
                await d.set_session_owner(f"s{k}", f"w{k}", 30.0)
                await d.health()
                done += 1
            except Exception as exc:  # the point of the test: nothing may escape
                failures.append(exc)
            await asyncio.sleep(0.002)

    async def more_calls(n: int) -> None:
        """Until the loops have made `n` more rounds of calls (or one failed)."""
        target = done + n
        await until(lambda: done >= target or failures, what=f"{n} more rounds of calls")

    tasks = [asyncio.create_task(router_loop(k)) for k in range(3)]
    await more_calls(10)  # against Redis
    server.stop()
    await until(lambda: not d.healthy, what="the outage noticed")
    await more_calls(10)  # served from the local view
    server.start()
    await until(lambda: d.healthy, what="Redis back")
    await more_calls(10)  # against Redis again
    stop.set()
    await asyncio.gather(*tasks)
    assert failures == []
    assert await d.wait_reconciled(10)
    assert d.stats["outages"] >= 1
    view = await fresh_view(server)
    try:
        for k in range(3):
            assert await view.get_session_owner(f"s{k}") == f"w{k}"
    finally:
        await view.close()


def test_open_directory_builds_the_configured_backend(redis_server: RedisServer) -> None:
    assert isinstance(open_directory(DirectorySettings()), InMemoryDirectory)
    settings = DirectorySettings(backend="redis", redis_url=redis_server.url, key_prefix="x")
    d = open_directory(settings)
    assert isinstance(d, ResilientDirectory) and d.primary.prefix == "{x}:"
    plain = open_directory(settings, resilient=False)
    assert isinstance(plain, RedisDirectory)
    asyncio.run(d.close())
    asyncio.run(plain.close())
    assert split_cluster_flag("redis://h:1/0?cluster=1&db=0") == ("redis://h:1/0?db=0", True)
    assert split_cluster_flag("redis://h:1/0") == ("redis://h:1/0", False)


def test_open_directory_passes_the_configured_bounds(redis_server: RedisServer) -> None:
    settings = DirectorySettings(
        backend="redis",
        redis_url=redis_server.url,
        redis_step_entries=7,
        engine_map_entries=9,
        max_pending_writes=11,
    )
    d = open_directory(settings)
    assert isinstance(d, ResilientDirectory) and d.max_pending == 11
    assert (d.primary.step_entries, d.primary.engine_map_limit) == (7, 9)
    plain = open_directory(DirectorySettings(backend="redis", redis_url=redis_server.url))
    assert isinstance(plain, ResilientDirectory) and plain.max_pending == 100_000
    assert (plain.primary.step_entries, plain.primary.engine_map_limit) == (256, 32_768)
    asyncio.run(d.close())
    asyncio.run(plain.close())


async def test_epoch_translations_are_kept_only_while_their_leases_may_live(
    server: RedisServer,
) -> None:
    """Claims made during an outage get real epochs on replay, and the provisional ones are
    translated from then on; once those leases ended (and a grace, 0 here) their translations
    go at the map's next pruning, while a later outage's, still live, stay and translate."""
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05, epoch_grace_s=0.0, epoch_map_min=16)

    async def outage_claims(first: int, lease_s: float) -> list[tuple[int, int]]:
        server.stop()
        held = []
        for i in range(first, first + 20):
            chain = tuple(block_hash_chain([i, *TOKENS[: 2 * BS - 1]], BS, ROOT))
            lease = await d.claim(Artifact(chain), "w1", lease_s)
            assert lease.epoch >= PROVISIONAL_EPOCH_BASE
            held.append((lease.artifact_id, lease.epoch))
        server.start()
        assert await d.wait_reconciled(10)
        return held

    try:
        await outage_claims(0, 1.0)
        assert len(d._epoch_map) == 20  # pruned once at 16, all live then
        ends = max(d._epoch_ends.values())
        await until(lambda: time.time() > ends, what="the replayed 1 s leases to end")
        live = await outage_claims(100, 60.0)
        assert set(d._epoch_map) == {epoch for _, epoch in live}
        for aid, epoch in live[:3]:
            renewed = await d.renew(aid, "w1", epoch, 60.0)
            assert renewed.epoch < PROVISIONAL_EPOCH_BASE
    finally:
        await d.close()


async def test_namespace_is_a_single_hash_tag() -> None:
    with pytest.raises(InvalidRequestError, match="namespace"):
        RedisDirectory.from_url("redis://127.0.0.1:1/0", "a{b}")


async def test_redis_down_from_the_start_then_up(server: RedisServer) -> None:
    server.stop()
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05)
    try:
        lease = await d.claim(Artifact(CHAIN[:4]), "w1", 60.0)
        await d.set_session_owner("s1", "w1", 60.0)
        assert (await d.lookup(CHAIN[:4], "s1")).owner == "w1"
        assert not (await d.health()).healthy
        server.start()
        assert await d.wait_reconciled(10)
        view = await fresh_view(server)
        try:
            m = await view.lookup(CHAIN[:4], "s1")
            assert (m.owner, m.session_owner) == ("w1", "w1")
        finally:
            await view.close()
        assert (await d.renew(CHAIN[3], "w1", lease.epoch, 60.0)).epoch < PROVISIONAL_EPOCH_BASE
    finally:
        await d.close()


async def test_a_hung_redis_times_out_into_the_local_view(server: RedisServer) -> None:
    timeout_s = 1.0
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=timeout_s)
    d = ResilientDirectory(primary, retry_interval_s=0.05)
    try:
        await d.claim(Artifact(CHAIN[:4]), "w1", 60.0)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            t0 = time.monotonic()
            assert (await d.lookup(CHAIN[:4])).owner == "w1"
            assert time.monotonic() - t0 < timeout_s + 5.0  # the socket timeout, not a hang
            t1 = time.monotonic()
            await d.set_session_owner("s1", "w1", 60.0)
            # already known down: straight to local, without waiting out the socket timeout
            assert time.monotonic() - t1 < timeout_s / 2
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await d.wait_reconciled(10)
        assert await d.get_session_owner("s1") == "w1"
    finally:
        await d.close()


async def test_a_restart_between_two_calls_is_noticed_and_repaired(server: RedisServer) -> None:
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05, boot_check_s=0.0)
    try:
        lease = await d.claim(Artifact(CHAIN[:8]), "w1", 60.0)
        server.stop()
        server.start()  # empty dataset; no call saw the outage
        await d.set_session_owner("s1", "w1", 60.0)
        assert await d.wait_reconciled(10)
        view = await fresh_view(server)
        try:
            m = await view.lookup(CHAIN[:8], "s1")
            assert (m.owner, m.session_owner) == ("w1", "w1")
            assert m.owner_epoch > lease.epoch  # the refilled dataset never repeats an epoch
        finally:
            await view.close()
        assert d.stats["resyncs"] == 1
    finally:
        await d.close()


async def stop_keeping_data(d: ResilientDirectory, server: RedisServer) -> None:
    with contextlib.suppress(RedisConnectionError):
        await d.primary.client.shutdown(save=True)  # keeps dump.rdb: comes back with its data
    server.stop()


async def test_a_transfer_during_an_outage_is_replayed_at_a_real_epoch(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    base = await d.claim(Artifact(CHAIN[:8]), "src", 60.0)
    delta = await d.claim(Artifact(CHAIN[:12], start=8), "src", 60.0, fence_epoch=base.epoch)
    await stop_keeping_data(d, server)
    # served by the local view, at a provisional epoch, as a claim would be
    assert await d.transfer(CHAIN[:12], "src", "dst", 60.0, 60.0, Tier.CPU) == 12
    m = await d.lookup(CHAIN[:12])
    assert (m.owner, m.owner_blocks) == ("dst", 12)
    provisional = m.owner_epoch
    assert provisional >= PROVISIONAL_EPOCH_BASE
    with pytest.raises(StaleEpochError):
        await d.renew(CHAIN[11], "src", delta.epoch, 60.0)
    assert (await d.health()).pending_reconcile == 1
    server.start()
    assert await d.wait_reconciled(10)
    assert (d.stats["resyncs"], d.stats["replayed"], d.stats["conflicts"]) == (0, 1, 0)
    view = await fresh_view(server)
    try:
        m = await view.lookup(CHAIN[:12])
        assert m.holdings == (
            Holding("dst", Tier.GPU, 12, HoldKind.OWNER),
            Holding("src", Tier.CPU, 12, HoldKind.REPLICA),
        )
        assert delta.epoch < m.owner_epoch < PROVISIONAL_EPOCH_BASE
    finally:
        await view.close()
    # the provisional epoch now means the real one; the source stays fenced
    assert (await d.renew(CHAIN[7], "dst", provisional, 60.0)).epoch == m.owner_epoch
    with pytest.raises(StaleEpochError):
        await d.renew(CHAIN[11], "src", delta.epoch, 60.0)
    local = await d.local.lookup(CHAIN[:12])  # what the next outage serves from
    assert (local.owner, local.owner_epoch, local.owner_blocks) == ("dst", m.owner_epoch, 12)


async def test_a_transfer_that_lost_on_replay_fences_its_provisional_owner(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    d = resilient
    await d.claim(Artifact(CHAIN[:8]), "src", 60.0)
    await stop_keeping_data(d, server)
    assert await d.transfer(CHAIN[:8], "src", "dst", 60.0, 60.0) == 8
    provisional = (await d.lookup(CHAIN[:8])).owner_epoch
    d.retry_interval_s = 0.5  # time for another router to act first once Redis is back
    server.start()
    other = await fresh_view(server)
    try:
        assert await other.drop_worker("src") == 1  # it saw src die: nothing left to hand over
        winner = await other.claim(Artifact(CHAIN[:8]), "w9", 60.0)
        assert await d.wait_reconciled(10)
        assert (d.stats["replayed"], d.stats["conflicts"]) == (1, 1)
        m = await d.lookup(CHAIN[:8])
        assert (m.owner, m.owner_epoch) == ("w9", winner.epoch)
        local = await d.local.lookup(CHAIN[:8])  # the local view follows Redis
        assert (local.owner, local.owner_epoch, local.owner_blocks) == ("w9", winner.epoch, 8)
        with pytest.raises(StaleEpochError):
            await d.renew(CHAIN[7], "dst", provisional, 60.0)
    finally:
        await other.close()


async def test_closing_during_a_long_replay_stops_it_and_returns(server: RedisServer) -> None:
    primary = RedisDirectory.from_url(server.url, "rs", socket_timeout_s=2.0)
    d = ResilientDirectory(primary, retry_interval_s=0.05)
    await queued_in_an_outage(d, server, 3000)
    await until(lambda: d.stats["replayed"] > 0, what="the replay under way")
    async with asyncio.timeout(30):
        await d.close()
    assert d._reconnect is None or d._reconnect.done()
    replayed = d.stats["replayed"]
    assert d.pending > 0 and not d.healthy, "closed mid-replay: the rest stays queued"
    await asyncio.sleep(0.2)  # nothing replays behind a closed directory
    assert d.stats["replayed"] == replayed


async def test_replica_holders_outlive_an_outage_and_a_lost_dataset(
    server: RedisServer, resilient: ResilientDirectory
) -> None:
    """A holder renewed during an outage is answered by the local view; after Redis lost its
    dataset the holder and its lines are pushed back, and its next renewal continues it."""
    d = resilient
    inc = 99
    assert await d.renew_replica_holder("w3", Tier.CPU, inc, 60.0) is False
    await d.add_held_replicas("w3", Tier.CPU, inc, CHAIN[:6])
    server.stop()
    assert await d.renew_replica_holder("w3", Tier.CPU, inc, 60.0) is True  # the local view
    assert (await d.lookup(CHAIN[:8])).longest("w3", Tier.CPU) == 6
    server.start()  # without persistence: the dataset is gone
    assert await d.wait_reconciled(10)
    view = await fresh_view(server)
    try:
        assert (await view.lookup(CHAIN[:8])).longest("w3", Tier.CPU) == 6
    finally:
        await view.close()
    assert await d.renew_replica_holder("w3", Tier.CPU, inc, 60.0) is True
    assert await d.drop_replicas("w3", Tier.CPU, CHAIN[4:6]) == 2
    assert (await d.lookup(CHAIN[:8])).longest("w3", Tier.CPU) == 4
