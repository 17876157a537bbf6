"""Restorable units from group-tagged KV events (a hybrid-attention engine, vLLM's
`group_idx`): the chain index takes only the attention chain group, a window group's removals
never cut it, and each worker's deepest restorable boundary per tier is in the lookup's Match.
Every directory test runs on the in-memory and the Redis backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.directory.base import Holding, HoldKind
from ownerserve.directory.restorable import GroupHoldings, GroupInfo, RestorableUnit
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from tests.ownerserve.directory.conftest import Backend

BS = 4
ROOT = chain_root("hybrid-model")
TOKENS = list(range(500, 500 + 16 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))
CSA, HCA, SWA, TAIL = 0, 1, 3, 4
"""Group indices as the emulator numbers a V4-like spec's groups (2: the indexer, unused)."""


def stored(group: int, first: int, n: int, tier: Tier = Tier.GPU) -> BlockStored:
    kind = {CSA: "compressed_attention", HCA: "compressed_attention", SWA: "sliding_window"}
    return BlockStored(
        tuple(range(first, first + n)),  # the engine hashes blocks by index: 0, 1, ...
        first - 1 if first else None,
        tuple(TOKENS[first * BS : (first + n) * BS]),
        BS,
        tier,
        group_idx=group,
        group_kind=kind.get(group, "state"),
        sliding_window=2 * BS if group == SWA else None,  # the window spans 2 blocks
    )


def removed(group: int, *blocks: int) -> BlockRemoved:
    return BlockRemoved(tuple(blocks), group_idx=group)


def batch(seq: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch(seq, 0.0, tuple(events))


async def test_window_removals_never_cut_the_attention_chain(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events(
        "w1",
        batch(1, stored(CSA, 0, 10), stored(HCA, 0, 10), stored(SWA, 0, 10), stored(TAIL, 0, 10)),
    )
    # the engine drops every window block but 4 and 5 (retained boundary 6) and 8, 9
    await d.apply_events("w1", batch(2, removed(SWA, 0, 1, 2, 3, 6, 7), removed(TAIL, 0, 1, 2)))
    m = await d.lookup(CHAIN[:12])
    # the chain index saw only the chain group: 10 blocks, untouched by the window's removals
    assert m.holdings == (Holding("w1", Tier.GPU, 10, HoldKind.CACHED),)
    # every group holds what boundary 10 needs: windows 8, 9 and the tail's block 9
    assert m.restorable == (RestorableUnit("w1", Tier.GPU, 10, 10, 4),)
    # the tail state at 10 goes: the deepest boundary with windows and tail is 6
    await d.apply_events("w1", batch(3, removed(TAIL, 9)))
    u = (await d.lookup(CHAIN[:12])).restorable_on("w1")
    assert u is not None and (u.blocks, u.sealed_blocks) == (6, 10)
    # a removal of the chain group does cut it, in both views
    await d.apply_events("w1", batch(4, removed(CSA, 5), removed(HCA, 5)))
    m = await d.lookup(CHAIN[:12])
    assert m.longest("w1") == 5
    # boundary 6 is gone with block 5, and no boundary before it has its windows (3 left)
    assert m.restorable_on("w1") == RestorableUnit("w1", Tier.GPU, 0, 5, 4)


async def test_dense_workers_events_and_matches_are_unchanged(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    plain = replace(stored(CSA, 0, 6), group_idx=None, group_kind=None)
    await d.apply_events("w1", batch(1, plain))
    m = await d.lookup(CHAIN[:8])
    assert m.longest("w1") == 6 and m.restorable == ()


async def test_restorable_per_tier_and_cleared_with_the_cache(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events(
        "w1",
        batch(1, stored(CSA, 0, 8), stored(SWA, 0, 8), stored(CSA, 0, 8, Tier.CPU)),
    )
    m = await d.lookup(CHAIN[:8])
    # the CPU tier holds sealed KV only: restorable there by rebuilding the windows
    assert set(m.restorable) == {
        RestorableUnit("w1", Tier.GPU, 8, 8, 2),
        RestorableUnit("w1", Tier.CPU, 0, 8, 2),
    }
    await d.apply_events("w1", batch(2, AllBlocksCleared()))
    assert (await d.lookup(CHAIN[:8])).restorable == ()
    await d.drop_worker("w1")
    assert (await d.lookup(CHAIN[:8])).restorable == ()


def test_the_chain_group_is_the_lowest_attention_group() -> None:
    g = GroupHoldings()
    g.register_worker("w", ROOT, BS)
    # a window group's events never reach the chain index
    out = g.split("w", batch(1, stored(SWA, 0, 2)))
    assert out.events == ()
    out = g.split("w", batch(2, stored(HCA, 0, 2), stored(CSA, 0, 2)))
    # HCA (group 1) came first and was the chain group until CSA (group 0) showed up
    assert [type(e).__name__ for e in out.events] == ["BlockStored", "BlockStored"]
    out = g.split("w", batch(3, stored(HCA, 2, 1), stored(CSA, 2, 1)))
    assert len(out.events) == 1 and isinstance(out.events[0], BlockStored)
    assert out.events[0].group_idx is None  # the chain index gets it untagged


def test_the_engine_hash_map_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from ownerserve.directory import restorable

    monkeypatch.setattr(restorable, "ENGINE_MAP_LIMIT", 4)
    g = GroupHoldings()
    g.register_worker("w", ROOT, BS)
    g.split("w", batch(1, stored(CSA, 0, 8), stored(SWA, 0, 8)))
    g.split("w", batch(2, removed(CSA, *range(2, 8)), removed(SWA, *range(8))))
    g.split("w", batch(3, stored(CSA, 8, 1)))  # its parent (block 7) is forgotten: not placed
    assert g.restorable("w", CHAIN) == [RestorableUnit("w", Tier.GPU, 0, 2, 2)]
    assert len(g._workers["w"].engine_map) == 2


def window_kept(group: int, first: int, n: int, kept: int) -> BlockStored:
    """A window group's store as vLLM 0.32 publishes it: the token range of blocks
    [first, first + n) and its parent, but the hashes of only its last `kept` blocks (the
    window and the retention interval dropped the others before they were cached)."""
    full = stored(group, first, n)
    return replace(full, engine_hashes=full.engine_hashes[n - kept :])


async def test_a_window_store_of_the_kept_blocks_only_is_placed_at_them(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    # vLLM publishes the window groups' stores of a step before the attention group's
    await d.apply_events("w1", batch(1, window_kept(SWA, 0, 6, 2), stored(CSA, 0, 6)))
    m = await d.lookup(CHAIN[:6])
    # the window holds blocks 4, 5: every group can restore boundary 6
    assert m.restorable_on("w1") == RestorableUnit("w1", Tier.GPU, 6, 6, 2)
    # a branch sharing blocks [0, 4): the attention group holds them, the window does not hold
    # blocks 2, 3, so nothing before boundary 6 is restorable (a dense view would say 4)
    branch = (await d.lookup(CHAIN[:4])).restorable_on("w1")
    assert branch is not None and (branch.blocks, branch.sealed_blocks) == (0, 4)
    # the branch's own prefill keeps blocks 2, 3 of the window (its attention blocks hit)
    await d.apply_events("w1", batch(2, window_kept(SWA, 0, 4, 2), stored(CSA, 0, 4)))
    assert (await d.lookup(CHAIN[:4])).restorable_on("w1") == RestorableUnit(
        "w1", Tier.GPU, 4, 4, 2
    )
    # the window's removal of block 3 goes by the engine hash the attention store mapped
    await d.apply_events("w1", batch(3, removed(SWA, 3)))
    u = (await d.lookup(CHAIN[:4])).restorable_on("w1")
    assert u is not None and u.blocks == 0


def test_a_window_store_before_any_attention_store_is_placed_at_its_last_blocks() -> None:
    g = GroupHoldings()
    g.register_worker("w", ROOT, BS)
    # no attention group's store maps these engine hashes: the kept blocks are the range's last
    g.split("w", batch(1, window_kept(SWA, 0, 6, 2)))
    assert g.held_blocks("w", SWA, CHAIN[:8]) == (False,) * 4 + (True, True, False, False)
    assert g.held_blocks("w", SWA, CHAIN[:8], Tier.CPU) == (False,) * 8
    assert g.groups_of("w") == (GroupInfo(SWA, "sliding_window", 2 * BS),)
    assert g._workers["w"].engine_map == {}  # placed, not learned
