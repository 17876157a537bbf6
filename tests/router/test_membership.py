"""Worker membership: removing a worker whose directory records or KV event subscription
cannot be cleaned up is reported (error, log, metric), not passed off as success; a worker's
KV per tier is counted from the event batches the router applies."""

from __future__ import annotations

import logging

import pytest

from ownerserve.config import settings_from_dict
from ownerserve.directory.base import Artifact
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.errors import DirectoryUnavailableError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import chain_root, hash_block
from ownerserve.types import Tier
from router import membership
from router.state import Router


class _FlakyDirectory(InMemoryDirectory):
    """Fails `drop_worker` as many times as told."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def drop_worker(self, worker_id: str, life: int | None = None) -> int:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("redis down")
        return await super().drop_worker(worker_id, life)


def _router(directory: InMemoryDirectory) -> Router:
    settings = settings_from_dict(
        {
            "models": [{"name": "tiny", "block_size": 4}],
            "workers": [{"id": "w0", "url": "http://127.0.0.1:9"}],
        }
    )
    return Router(settings, directory=directory)


class _FailingSubscriber:
    worker = "w0"

    async def close(self) -> None:
        raise OSError("socket already gone")


def _count(counter) -> float:
    return counter._value.get()


async def test_a_failing_directory_drop_is_an_error_and_removing_again_retries_it(caplog):
    router = _router(_FlakyDirectory(failures=1))
    with caplog.at_level(logging.WARNING), pytest.raises(DirectoryUnavailableError):
        await membership.remove_worker(router, "w0")
    assert router.pool.get("w0") is None and "w0" in router.undropped
    assert _count(router.metrics.drop_worker_errors) == 1
    assert any(r.exc_info and "redis down" in str(r.exc_info[1]) for r in caplog.records)
    assert await membership.remove_worker(router, "w0")  # the retry reaches the directory
    assert not router.undropped
    assert not await membership.remove_worker(router, "w0")


async def test_a_subscription_that_fails_to_close_is_logged_and_counted(caplog):
    router = _router(InMemoryDirectory())
    router.subscribers.append(_FailingSubscriber())
    with caplog.at_level(logging.WARNING):
        assert await membership.remove_worker(router, "w0")
    assert router.subscribers == []
    assert _count(router.metrics.subscriber_close_errors) == 1
    assert any(isinstance(r.exc_info[1], OSError) for r in caplog.records if r.exc_info)


async def test_kv_events_of_a_dead_worker_do_not_bring_back_what_its_death_dropped():
    # the race CI hit: the worker dies, the directory forgets it, and a batch it published just
    # before dying is still queued in the subscription
    directory = InMemoryDirectory()
    router = _router(directory)
    root = chain_root("tiny")
    await directory.register_worker("w0", root, 4)
    state = router.pool.get("w0")
    assert state is not None
    sink = membership.LiveWorkerSink(directory, state)
    block = hash_block(root, [1, 2, 3, 4])

    def stored(seq: int) -> EventBatch:
        return EventBatch(seq, float(seq), (BlockStored((seq,), None, (1, 2, 3, 4), 4),))

    await router.pool.mark_dead(state)
    assert (await sink.apply_events("w0", stored(0))).stored == 0
    assert (await directory.lookup((block,))).longest("w0", Tier.GPU) == 0

    state.healthy = True  # it answers again: what it publishes now counts
    assert (await sink.apply_events("w0", stored(1))).stored == 1
    assert (await directory.lookup((block,))).longest("w0", Tier.GPU) == 1


async def test_a_replicas_late_verdict_on_a_death_another_dropped_spares_the_next_life():
    # two router replicas on one directory (Redis in production: the same race against a
    # real redis-server is in tests/ownerserve/directory/test_redis_backend.py)
    directory = InMemoryDirectory()
    a, b = _router(directory), _router(directory)
    for router in (a, b):
        await membership.register(router, "w0")
    await membership.on_worker_dead(a, "w0")  # A holds it dead and drops it
    await membership.on_worker_back(a, "w0")  # it is back; A sees it, it records
    block = hash_block(chain_root("tiny"), [1, 2, 3, 4])
    lease = await directory.claim(Artifact((block,)), "w0", 60.0)
    await directory.set_session_owner("s1", "w0", 60.0)

    await membership.on_worker_dead(b, "w0")  # B's verdict on the death A dropped

    assert (await directory.lookup((block,), "s1")).owner_epoch == lease.epoch
    assert await directory.get_session_owner("s1") == "w0"
    await membership.on_worker_back(b, "w0")
    await membership.on_worker_dead(b, "w0")  # a death of the life B saw: dropped
    assert (await directory.lookup((block,), "s1")).owner is None


async def test_a_batch_of_a_life_another_replica_dropped_is_refused_and_the_next_counts():
    # replica B still holds the worker alive when replica A drops its life; a batch B had
    # queued from before the death must not name the dead life's blocks in the next one
    directory = InMemoryDirectory()
    a, b = _router(directory), _router(directory)
    for router in (a, b):
        await membership.register(router, "w0")
    state = b.pool.get("w0")
    assert state is not None and state.directory_life == 0
    sink = membership.LiveWorkerSink(directory, state)
    root = chain_root("tiny")
    first, second = hash_block(root, [1, 2, 3, 4]), hash_block(root, [5, 6, 7, 8])

    await membership.on_worker_dead(a, "w0")
    late = EventBatch(3, 3.0, (BlockStored((1,), None, (1, 2, 3, 4), 4),))
    result = await sink.apply_events("w0", late)
    assert result.fenced == 1 and result.stored == 0
    assert (await directory.lookup((first,))).longest("w0", Tier.GPU) == 0
    assert state.directory_life == 1  # B learnt the life it missed

    fresh = EventBatch(0, 4.0, (BlockStored((2,), None, (5, 6, 7, 8), 4),))
    assert (await sink.apply_events("w0", fresh)).stored == 1
    assert (await directory.lookup((second,))).longest("w0", Tier.GPU) == 1


async def test_kv_events_count_each_tiers_blocks_and_a_clear_or_a_resync_empties_them():
    directory = InMemoryDirectory()
    router = _router(directory)
    await directory.register_worker("w0", chain_root("tiny"), 4)
    state = router.pool.get("w0")
    assert state is not None
    sink = membership.LiveWorkerSink(directory, state)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
    events = (
        BlockStored((1, 2, 3), None, tokens, 4),
        BlockStored((1, 2), None, tokens[:8], 4, Tier.CPU),
        BlockStored((1,), None, tokens[:4], 4, Tier.SSD),
        BlockStored((9, 10), None, tokens[:8], 4, group_idx=1),  # a window group: not counted
        BlockRemoved((3,)),
        BlockRemoved((7, 8, 9), Tier.SSD),  # more than it stored: floored at 0
    )
    await sink.apply_events("w0", EventBatch(0, 0.0, events))
    assert (state.gpu_blocks, state.cpu_blocks, state.ssd_blocks) == (2, 2, 0)
    assert state.tier_blocks(Tier.GPU) == (2, 4) and state.tier_blocks(Tier.CPU) == (2, 4)
    assert state.cached_tokens == 8
    await sink.apply_events("w0", EventBatch(1, 1.0, (AllBlocksCleared(),)))
    assert (state.gpu_blocks, state.cpu_blocks, state.ssd_blocks) == (0, 0, 0)
    await sink.apply_events("w0", EventBatch(2, 2.0, events[:2]))
    assert (state.gpu_blocks, state.cpu_blocks) == (3, 2)
    await sink.drop_worker("w0")  # the engine restarted (its seq went back)
    assert (state.gpu_blocks, state.cpu_blocks, state.ssd_blocks) == (0, 0, 0)


async def test_a_dead_or_removed_worker_keeps_none_of_the_leases_the_router_held_for_it():
    directory = InMemoryDirectory()
    router = _router(directory)
    lease = await directory.claim(Artifact((11, 12)), "w0", 60.0)
    router.committed_leases.held(lease, 2)
    assert router.committed_leases.blocks("w0") == 2
    await membership.on_worker_dead(router, "w0")
    assert router.committed_leases.blocks("w0") == 0
    router.committed_leases.held(lease, 2)
    assert await membership.remove_worker(router, "w0")
    assert router.committed_leases.blocks("w0") == 0 and not router.committed_leases
