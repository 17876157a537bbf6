"""The paged KV cache: prefix matching, reference counts, LRU eviction and the events they emit."""

from __future__ import annotations

import pytest

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from workers.emulator.kv_cache import (
    BlockPool,
    CachedBlock,
    HostPool,
    NewBlock,
    prompt_block_hashes,
)

BS = 4
ROOT = chain_root("m")


def chain(tokens: list[int]) -> list[int]:
    return block_hash_chain(tokens, BS, ROOT)


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and register the full blocks of `tokens`, as a finished prefill would."""
    hashes = chain(tokens)
    ids = pool.allocate(len(hashes))
    assert ids is not None
    pool.register(
        [
            NewBlock(bid, h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]))
            for i, (bid, h) in enumerate(zip(ids, hashes, strict=True))
        ]
    )
    return ids


def test_registered_blocks_match_as_a_prefix_and_emit_one_stored_event_per_run() -> None:
    pool = BlockPool(8, BS)
    tokens = list(range(12))
    fill(pool, tokens)
    events = pool.drain_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].engine_hashes == tuple(chain(tokens))
    assert events[0].parent_engine_hash is None
    assert events[0].token_ids == tuple(tokens)
    assert pool.match_prefix(chain(tokens + [99] * 4)) == 3
    assert pool.match_prefix(chain([7, *tokens[1:]])) == 0


def test_freed_cached_blocks_stay_resident_until_space_is_needed() -> None:
    pool = BlockPool(4, BS)
    ids = fill(pool, list(range(8)))
    assert pool.usage == pytest.approx(0.5)
    pool.free(ids)
    assert pool.usage == 0.0
    assert pool.num_cached == 2
    # Two empty blocks are reused before any cached one is evicted.
    got = pool.allocate(2)
    assert got is not None and not set(got) & set(ids)
    assert pool.num_cached == 2
    pool.drain_events()
    pool.allocate(1)
    removed = pool.drain_events()
    assert removed == [BlockRemoved(engine_hashes=(chain(list(range(8)))[1],))]


def test_eviction_takes_the_least_recently_freed_chain_tail_first() -> None:
    pool = BlockPool(4, BS)
    a = fill(pool, [1] * 8)
    b = fill(pool, [2] * 8)
    pool.free(a)
    pool.free(b)
    pool.drain_events()
    assert pool.allocate(1) is not None
    (event,) = pool.drain_events()
    assert isinstance(event, BlockRemoved)
    assert event.engine_hashes == (chain([1] * 8)[1],)  # a's tail, not its head
    assert pool.match_prefix(chain([1] * 8)) == 1
    assert pool.match_prefix(chain([2] * 8)) == 2


def test_referenced_blocks_are_never_evicted() -> None:
    pool = BlockPool(2, BS)
    fill(pool, [5] * 8)
    assert pool.allocate(1) is None
    assert pool.num_cached == 2


def test_touch_reuses_cached_blocks_and_refcounts_guard_the_free_list() -> None:
    pool = BlockPool(4, BS)
    tokens = [3] * 8
    ids = fill(pool, tokens)
    pool.free(ids)
    again = pool.touch(chain(tokens))
    assert again == ids
    assert pool.free_after_touch([]) == 2
    other = pool.touch(chain(tokens))
    assert [pool.ref_count(b) for b in other] == [2, 2]
    pool.free(again)
    pool.free(other)
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(other)


def test_duplicate_hash_in_another_block_is_not_registered_twice() -> None:
    pool = BlockPool(4, BS)
    fill(pool, [4] * 4)
    pool.drain_events()
    dup = pool.allocate(1)
    assert dup is not None
    h = chain([4] * 4)[0]
    assert pool.register([NewBlock(dup[0], h, None, (4, 4, 4, 4))]) == []
    assert pool.drain_events() == []
    pool.free(dup)
    assert pool.num_cached == 1


def test_insert_copies_blocks_from_elsewhere_and_reports_them_stored() -> None:
    src = BlockPool(4, BS)
    tokens = list(range(8))
    fill(src, tokens)
    read = src.read([*chain(tokens), 12345])
    assert read[-1] is None
    blocks = [b for b in read if b is not None]
    dst = BlockPool(4, BS)
    ids = dst.insert(blocks)
    assert len(ids) == 2
    assert dst.match_prefix(chain(tokens)) == 2
    (event,) = dst.drain_events()
    assert isinstance(event, BlockStored) and event.token_ids == tuple(tokens)
    # Inserting again references the resident copies instead of allocating.
    assert dst.insert(blocks) == ids
    assert dst.num_free == 2


def test_insert_stops_when_no_block_is_free() -> None:
    dst = BlockPool(1, BS)
    blocks = [CachedBlock(h, None, (0,) * BS) for h in (11, 12)]
    assert len(dst.insert(blocks)) == 1


def test_reset_clears_everything_only_when_idle() -> None:
    pool = BlockPool(4, BS)
    ids = fill(pool, [9] * 8)
    assert not pool.reset()
    pool.free(ids)
    pool.drain_events()
    assert pool.reset()
    assert pool.num_cached == 0
    assert pool.drain_events() == [AllBlocksCleared()]


@pytest.mark.parametrize("n", [0, 3, 16, 17, 100, 1000])
def test_in_place_prompt_hashing_equals_the_shared_chain(n: int) -> None:
    tokens = [(i * 7919) % 70000 for i in range(n)]
    assert prompt_block_hashes(tokens, 16, ROOT) == block_hash_chain(tokens, 16, ROOT)


def blocks_of(tokens: list[int]) -> list[CachedBlock]:
    """The full blocks of `tokens` as a request offers them to the CPU tier."""
    hashes = chain(tokens)
    return [
        CachedBlock(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]))
        for i, h in enumerate(hashes)
    ]


def test_cpu_tier_stores_offered_blocks_once_each_with_a_cpu_stored_event_per_block() -> None:
    host = HostPool(8, BS)
    a = blocks_of(list(range(12)))
    assert host.store(a) and host.store(a)  # the second offer finds them all resident
    assert host.match_prefix([b.block_hash for b in a]) == 3 and host.num_cached == 3
    events = host.drain_events()
    assert events == [
        BlockStored((b.block_hash,), b.parent_hash, b.token_ids, BS, Tier.CPU) for b in a
    ]
    assert host.stored_blocks == 3 and host.usage == 0.0


def test_cpu_tier_is_bounded_and_evicts_the_least_recently_used_with_a_cpu_removal() -> None:
    host = HostPool(4, BS)
    old, new = blocks_of(list(range(8))), blocks_of(list(range(100, 112)))
    host.store(old)
    host.drain_events()
    assert host.store(new)
    assert host.num_cached == 4 and host.evicted_blocks == 1
    events = host.drain_events()
    assert events[0] == BlockRemoved((old[0].block_hash,), Tier.CPU)
    assert events[1:] == [
        BlockStored((b.block_hash,), b.parent_hash, b.token_ids, BS, Tier.CPU) for b in new
    ]
    assert not host.contains(old[0].block_hash) and host.contains(old[1].block_hash)


def test_a_finished_request_makes_its_blocks_recent_with_its_prefix_evicted_last() -> None:
    host = HostPool(4, BS)
    a, b = blocks_of(list(range(8))), blocks_of(list(range(50, 58)))
    host.store(a)
    host.store(b)
    host.touch([x.block_hash for x in a])  # a's request finished: a is now the most recent
    host.store(blocks_of(list(range(200, 204))))
    assert not host.contains(b[0].block_hash)  # b's prefix was least recent
    host.store(blocks_of(list(range(300, 304))))
    assert not host.contains(b[1].block_hash) and host.num_cached == 4
    host.store(blocks_of(list(range(400, 404))))
    assert not host.contains(a[1].block_hash) and host.contains(a[0].block_hash)


def test_blocks_being_loaded_and_blocks_of_the_offer_are_never_evicted() -> None:
    host = HostPool(3, BS)
    a = blocks_of(list(range(12)))
    host.store(a)
    host.pin([a[0].block_hash, a[1].block_hash])
    assert host.usage == pytest.approx(2 / 3)
    assert host.store(blocks_of(list(range(100, 104))))  # only a[2] may go
    assert host.contains(a[0].block_hash) and not host.contains(a[2].block_hash)
    host.drain_events()
    # Neither pinned blocks nor the offer's own resident blocks make room: refused whole.
    offer = [*blocks_of(list(range(100, 104))), *blocks_of(list(range(500, 504)))]
    assert not host.store(offer)
    assert host.store_failures == 1 and host.drain_events() == []
    host.unpin([a[0].block_hash, a[1].block_hash])
    assert host.usage == 0.0 and host.store(offer)
    assert host.contains(a[1].block_hash) and not host.contains(a[0].block_hash)


def test_cpu_tier_reset_drops_everything_without_events() -> None:
    host = HostPool(4, BS)
    host.store(blocks_of(list(range(8))))
    host.drain_events()
    host.reset()
    assert host.num_cached == 0 and host.drain_events() == []
