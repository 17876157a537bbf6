"""The Directory contract: every test runs on the in-memory and on the Redis backend."""

from __future__ import annotations

import pytest

from ownerserve.directory.base import (
    Artifact,
    CachedCounts,
    Directory,
    Holding,
    HoldKind,
    Lease,
)
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from tests.ownerserve.directory.conftest import Backend

BS = 4
ROOT = chain_root("test-model")
TOKENS = list(range(1000, 1000 + 64 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))  # 64 blocks
# a branch sharing the first 10 blocks of CHAIN
BRANCH = tuple(block_hash_chain(TOKENS[: 10 * BS] + list(range(7, 7 + 20 * BS)), BS, ROOT))
LONG = 60.0
SHORT = 0.3
"""Over after `backend.advance(SHORT + 0.1)`; checked only once it is over."""
SHORT_SEEN = 1.0
"""Over after `backend.advance(SHORT_SEEN + 0.1)`, and seen alive before that: with Redis the
TTL runs in real time, so it must outlast a few calls on a busy machine."""


def art(n: int, start: int = 0, chain: tuple[int, ...] = CHAIN, **kw: object) -> Artifact:
    return Artifact(chain[:n], start=start, **kw)  # type: ignore[arg-type]


def stored(
    engine: list[int], parent: int | None, first_block: int, tier: Tier = Tier.GPU
) -> BlockStored:
    """BlockStored of CHAIN's blocks first_block.. with engine hashes `engine`."""
    toks = TOKENS[first_block * BS : (first_block + len(engine)) * BS]
    return BlockStored(tuple(engine), parent, tuple(toks), BS, tier)


def eng(i: int) -> int:
    """The engine's own hash of CHAIN block i: unrelated to ours, as with real engines."""
    return 900_000 + i


# --- lookup and claim ----------------------------------------------------------------------------


async def test_lookup_of_an_empty_directory_holds_nothing(backend: Backend) -> None:
    m = await backend.directory.lookup(CHAIN[:8], "s-none")
    assert (m.chain_len, m.holdings, m.owner, m.owner_blocks, m.session_owner) == (
        8,
        (),
        None,
        0,
        None,
    )
    assert (await backend.directory.lookup([])).chain_len == 0


async def test_claim_makes_the_worker_owner_of_the_whole_prefix(backend: Backend) -> None:
    d = backend.directory
    lease = await d.claim(art(8, size_bytes=4096, kv_type="dense", tier=Tier.GPU), "w1", LONG)
    assert (lease.artifact_id, lease.worker) == (CHAIN[7], "w1")
    assert lease.epoch >= 1
    m = await d.lookup(CHAIN[:16])
    assert m.holdings == (Holding("w1", Tier.GPU, 8, HoldKind.OWNER),)
    assert (m.owner, m.owner_blocks, m.owner_epoch, m.owner_artifact_id) == (
        "w1",
        8,
        lease.epoch,
        CHAIN[7],
    )
    # a shorter chain ending inside the artifact is owned up to its end
    assert (await d.lookup(CHAIN[:5])).owner_blocks == 5


async def test_second_claimer_gets_the_live_owners_lease(backend: Backend) -> None:
    d = backend.directory
    first = await d.claim(art(8), "w1", LONG)
    second = await d.claim(art(8), "w2", LONG)
    assert second == first
    assert (await d.lookup(CHAIN[:8])).owner == "w1"


async def test_reclaim_by_the_owner_keeps_the_epoch_and_extends(backend: Backend) -> None:
    d = backend.directory
    first = await d.claim(art(8), "w1", SHORT_SEEN)
    again = await d.claim(art(8), "w1", LONG)
    assert again.epoch == first.epoch
    assert again.expires_at > first.expires_at


async def test_claim_takes_only_free_blocks(backend: Backend) -> None:
    d = backend.directory
    a = await d.claim(art(4), "w1", LONG)
    b = await d.claim(art(8), "w2", LONG)  # blocks 0-3 stay with w1
    assert b.worker == "w2" and b.epoch > a.epoch
    m = await d.lookup(CHAIN[:8])
    assert m.holdings == (
        Holding("w1", Tier.GPU, 4, HoldKind.OWNER),
        Holding("w2", Tier.GPU, 8, HoldKind.OWNER),
    )
    assert (m.owner, m.owner_blocks) == ("w2", 8)
    assert (await d.lookup(CHAIN[:4])).owner == "w1"
    # claiming a prefix that ends inside w1's artifact returns w1's lease
    inner = await d.claim(art(3), "w3", LONG)
    assert (inner.worker, inner.epoch, inner.artifact_id) == ("w1", a.epoch, CHAIN[3])


async def test_delta_artifacts_append_to_a_session_prefix(backend: Backend) -> None:
    d = backend.directory
    base = await d.claim(art(8), "w1", LONG)
    delta = await d.claim(art(12, start=8, tier=Tier.CPU), "w1", LONG)
    assert delta.epoch != base.epoch
    m = await d.lookup(CHAIN[:20])
    assert m.holdings == (
        Holding("w1", Tier.GPU, 8, HoldKind.OWNER),
        Holding("w1", Tier.CPU, 12, HoldKind.OWNER),
    )
    assert (m.owner_blocks, m.owner_artifact_id) == (12, CHAIN[11])
    # a branch shares only the first 10 blocks
    branch = await d.lookup(BRANCH)
    assert (branch.owner, branch.owner_blocks) == ("w1", 10)


async def test_epochs_never_repeat_even_after_release(backend: Backend) -> None:
    d = backend.directory
    seen = []
    for _ in range(3):
        lease = await d.claim(art(4), "w1", LONG)
        seen.append(lease.epoch)
        await d.release(lease.artifact_id, "w1", lease.epoch)
    assert seen == sorted(set(seen))


# --- renew, release, expiry, fencing -------------------------------------------------------------


async def test_renew_extends_a_live_lease_and_refuses_stale_epochs(backend: Backend) -> None:
    d = backend.directory
    lease = await d.claim(art(8), "w1", SHORT_SEEN)
    renewed = await d.renew(lease.artifact_id, "w1", lease.epoch, LONG)
    assert renewed.epoch == lease.epoch and renewed.expires_at > lease.expires_at
    with pytest.raises(StaleEpochError):
        await d.renew(lease.artifact_id, "w1", lease.epoch + 1, LONG)
    with pytest.raises(StaleEpochError):
        await d.renew(lease.artifact_id, "w2", lease.epoch, LONG)
    with pytest.raises(StaleEpochError):
        await d.renew(CHAIN[40], "w1", 1, LONG)  # never claimed


async def test_release_frees_the_blocks_and_checks_the_epoch(backend: Backend) -> None:
    d = backend.directory
    lease = await d.claim(art(8), "w1", LONG)
    with pytest.raises(StaleEpochError):
        await d.release(lease.artifact_id, "w1", lease.epoch + 7)
    await d.release(lease.artifact_id, "w1", lease.epoch)
    assert (await d.lookup(CHAIN[:8])).owner is None
    assert await d.artifact_info(lease.artifact_id) is None
    await d.release(lease.artifact_id, "w1", lease.epoch)  # already gone: nothing to do
    assert (await d.claim(art(8), "w2", LONG)).worker == "w2"


async def test_expired_lease_is_claimable_and_the_stale_owner_is_fenced(backend: Backend) -> None:
    d = backend.directory
    old = await d.claim(art(8), "w1", SHORT)
    await backend.advance(SHORT + 0.1)
    assert (await d.lookup(CHAIN[:8])).owner is None
    with pytest.raises(StaleEpochError):  # expired: renewing is no longer allowed
        await d.renew(old.artifact_id, "w1", old.epoch, LONG)
    new = await d.claim(art(8), "w2", LONG)
    assert (new.worker, new.artifact_id) == ("w2", old.artifact_id)
    assert new.epoch > old.epoch
    with pytest.raises(StaleEpochError):
        await d.renew(old.artifact_id, "w1", old.epoch, LONG)
    with pytest.raises(StaleEpochError):
        await d.release(old.artifact_id, "w1", old.epoch)
    with pytest.raises(StaleEpochError):  # the stale owner's commit of a delta
        await d.claim(art(12, start=8), "w1", LONG, fence_epoch=old.epoch)
    m = await d.lookup(CHAIN[:12])
    assert (m.owner, m.owner_epoch, m.owner_blocks) == ("w2", new.epoch, 8)


async def test_fenced_commit_extends_the_prefix_of_the_current_owner(backend: Backend) -> None:
    d = backend.directory
    base = await d.claim(art(8), "w1", LONG)
    delta = await d.claim(art(12, start=8), "w1", LONG, fence_epoch=base.epoch)
    assert delta.worker == "w1" and delta.artifact_id == CHAIN[11]
    with pytest.raises(StaleEpochError):
        await d.claim(art(16, start=12), "w2", LONG, fence_epoch=delta.epoch)
    with pytest.raises(InvalidRequestError):
        await d.claim(art(8), "w1", LONG, fence_epoch=base.epoch)  # start 0: nothing to extend


async def test_reclaim_after_expiry_does_not_leave_old_blocks_owned(backend: Backend) -> None:
    d = backend.directory
    await d.claim(art(8), "w1", SHORT)
    await backend.advance(SHORT + 0.1)
    await d.claim(art(8, start=6), "w2", LONG)  # same id, fewer blocks
    m = await d.lookup(CHAIN[:8])
    assert m.holdings == (Holding("w2", Tier.GPU, 8, HoldKind.OWNER),)
    assert (await d.lookup(CHAIN[:6])).owner is None


# --- replicas, sessions, forks, metadata ---------------------------------------------------------


async def test_replicas_are_read_only_copies_that_expire(backend: Backend) -> None:
    d = backend.directory
    await d.claim(art(8), "w1", LONG)
    await d.add_replica(CHAIN[7], "w2", Tier.CPU, SHORT_SEEN)  # the artifact's blocks
    await d.add_replica(CHAIN[11], "w3", Tier.SSD, LONG, blocks=CHAIN[:12])
    m = await d.lookup(CHAIN[:16])
    assert m.holdings == (
        Holding("w1", Tier.GPU, 8, HoldKind.OWNER),
        Holding("w2", Tier.CPU, 8, HoldKind.REPLICA),
        Holding("w3", Tier.SSD, 12, HoldKind.REPLICA),
    )
    assert m.owner == "w1"  # a replica never owns
    assert (await d.lookup(CHAIN[:3])).longest("w2", Tier.CPU) == 3
    await backend.advance(SHORT_SEEN + 0.1)
    m = await d.lookup(CHAIN[:16])
    assert m.longest("w2") == 0 and m.longest("w3", Tier.SSD) == 12
    assert await d.sweep() >= 1


async def test_replica_of_an_unclaimed_artifact_covers_its_last_block(backend: Backend) -> None:
    d = backend.directory
    await d.add_replica(CHAIN[5], "w2", Tier.GPU, LONG)
    m = await d.lookup(CHAIN[:8])
    assert m.holdings == (Holding("w2", Tier.GPU, 6, HoldKind.REPLICA),)


async def test_session_owner_with_ttl_and_in_lookup(backend: Backend) -> None:
    d = backend.directory
    assert await d.get_session_owner("s1") is None
    await d.set_session_owner("s1", "w1", LONG)
    await d.set_session_owner("s2", "w2", SHORT)
    assert await d.get_session_owner("s1") == "w1"
    assert (await d.lookup(CHAIN[:4], "s1")).session_owner == "w1"
    await d.set_session_owner("s1", "w3", LONG)  # reassigned
    assert (await d.lookup(CHAIN[:4], "s1")).session_owner == "w3"
    await backend.advance(SHORT + 0.1)
    assert await d.get_session_owner("s2") is None


async def test_fork_refs_count_branches_sharing_a_prefix(backend: Backend) -> None:
    d = backend.directory
    await d.claim(art(8), "w1", LONG)
    assert await d.add_fork_ref(CHAIN[7], "branch-a") == 1
    assert await d.add_fork_ref(CHAIN[7], "branch-b") == 2
    assert await d.add_fork_ref(CHAIN[7], "branch-b") == 2  # idempotent per branch
    info = await d.artifact_info(CHAIN[7])
    assert info is not None and info.fork_refs == 2
    assert await d.drop_fork_ref(CHAIN[7], "branch-a") == 1
    assert await d.drop_fork_ref(CHAIN[7], "branch-b") == 0
    assert await d.drop_fork_ref(CHAIN[7], "branch-b") == 0


async def test_sweep_drops_the_fork_refs_of_sessions_that_ended(backend: Backend) -> None:
    d = backend.directory
    await d.claim(art(8), "w1", LONG)
    await d.set_session_owner("ends", "w1", SHORT_SEEN)
    await d.set_session_owner("lives", "w2", LONG)
    await d.add_fork_ref(CHAIN[7], "ends")
    assert await d.add_fork_ref(CHAIN[7], "lives") == 2
    await backend.advance(SHORT_SEEN + 0.1)
    await d.sweep()
    info = await d.artifact_info(CHAIN[7])
    assert info is not None and info.fork_refs == 1
    assert await d.drop_fork_ref(CHAIN[7], "lives") == 0


async def test_artifact_metadata_and_reuse_count(backend: Backend) -> None:
    d = backend.directory
    lease = await d.claim(art(8, size_bytes=123_456, kv_type="csa_main", tier=Tier.CPU), "w1", LONG)
    info = await d.artifact_info(CHAIN[7])
    assert info is not None
    assert (info.worker, info.epoch, info.live, info.start, info.blocks) == (
        "w1",
        lease.epoch,
        True,
        0,
        8,
    )
    assert (info.size_bytes, info.kv_type, info.tier, info.reuse_count) == (
        123_456,
        "csa_main",
        Tier.CPU,
        0,
    )
    await d.lookup(CHAIN[:10])
    await d.lookup(CHAIN[:4])
    await d.lookup(BRANCH)
    after = await d.artifact_info(CHAIN[7])
    assert after is not None and after.reuse_count == 3
    assert after.last_access >= info.created_at
    assert await d.artifact_info(CHAIN[20]) is None


# --- KV events -----------------------------------------------------------------------------------


async def test_kv_events_map_engine_hashes_onto_our_chain(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    r1 = await d.apply_events(
        "w1", EventBatch(1, 0.0, (stored([eng(0), eng(1), eng(2)], None, 0),))
    )
    r2 = await d.apply_events("w1", EventBatch(2, 0.0, (stored([eng(3), eng(4)], eng(2), 3),)))
    assert (r1.stored, r2.stored, r1.gap, r2.skipped) == (3, 2, False, 0)
    m = await d.lookup(CHAIN[:8])
    assert m.holdings == (Holding("w1", Tier.GPU, 5, HoldKind.CACHED),)
    assert m.owner is None  # cached is not owned
    # evicting block 2 cuts the contiguous prefix to 2 blocks
    r3 = await d.apply_events("w1", EventBatch(3, 0.0, (BlockRemoved((eng(2),)),)))
    assert r3.removed == 1
    assert (await d.lookup(CHAIN[:8])).longest("w1", Tier.GPU) == 2


async def test_kv_events_per_tier_and_all_cleared(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    await d.register_worker("w2", ROOT, BS)
    await d.apply_events(
        "w1",
        EventBatch(
            1,
            0.0,
            (
                stored([eng(i) for i in range(6)], None, 0),
                stored([eng(i) for i in range(3)], None, 0, Tier.CPU),
            ),
        ),
    )
    await d.apply_events("w2", EventBatch(1, 0.0, (stored([eng(0), eng(1)], None, 0),)))
    m = await d.lookup(CHAIN[:10])
    assert m.holdings == (
        Holding("w1", Tier.GPU, 6, HoldKind.CACHED),
        Holding("w1", Tier.CPU, 3, HoldKind.CACHED),
        Holding("w2", Tier.GPU, 2, HoldKind.CACHED),
    )
    # evicting from the GPU leaves the CPU copy of the same block
    await d.apply_events("w1", EventBatch(2, 0.0, (BlockRemoved((eng(1),), Tier.GPU),)))
    m = await d.lookup(CHAIN[:10])
    assert (m.longest("w1", Tier.GPU), m.longest("w1", Tier.CPU)) == (1, 3)
    await d.apply_events("w1", EventBatch(3, 0.0, (AllBlocksCleared(),)))
    m = await d.lookup(CHAIN[:10])
    assert m.holdings == (Holding("w2", Tier.GPU, 2, HoldKind.CACHED),)


async def test_kv_events_gap_duplicate_and_resync(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events("w1", EventBatch(5, 0.0, (stored([eng(0), eng(1)], None, 0),)))
    dup = await d.apply_events("w1", EventBatch(5, 0.0, (stored([eng(2)], eng(1), 2),)))
    assert dup.duplicate and dup.expected_seq == 6 and dup.stored == 0
    gap = await d.apply_events("w1", EventBatch(9, 0.0, (stored([eng(5)], None, 0),)))
    assert (gap.gap, gap.expected_seq, gap.stored) == (True, 6, 1)
    # the view was dropped and rebuilt from the batch that revealed the gap
    m = await d.lookup(CHAIN[:4])
    assert m.longest("w1") == 1
    # blocks stored before the gap are forgotten: a child of one of them cannot be placed
    child = await d.apply_events("w1", EventBatch(10, 0.0, (stored([eng(2)], eng(1), 2),)))
    assert (child.stored, child.skipped) == (0, 1)


async def test_kv_events_that_cannot_be_mapped_are_skipped(backend: Backend) -> None:
    d = backend.directory
    with pytest.raises(InvalidRequestError):
        await d.apply_events("nobody", EventBatch(1, 0.0, ()))
    await d.register_worker("w1", ROOT, BS)
    wrong_size = BlockStored((1,), None, tuple(range(8)), 8)
    unknown_parent = stored([eng(3)], 424242, 3)
    r = await d.apply_events("w1", EventBatch(1, 0.0, (wrong_size, unknown_parent)))
    assert (r.stored, r.skipped) == (0, 2)
    assert (await d.lookup(CHAIN[:4])).holdings == ()


async def test_reregistering_with_another_root_drops_the_cached_view(backend: Backend) -> None:
    d = backend.directory
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events("w1", EventBatch(1, 0.0, (stored([eng(0), eng(1)], None, 0),)))
    await d.register_worker("w1", ROOT, BS)  # same: nothing changes
    assert (await d.lookup(CHAIN[:2])).longest("w1") == 2
    await d.register_worker("w1", chain_root("other-model"), BS)
    assert (await d.lookup(CHAIN[:2])).longest("w1") == 0
    # its seq was reset: a restarted publisher's seq 0 is accepted
    r = await d.apply_events("w1", EventBatch(0, 0.0, ()))
    assert not r.duplicate


# --- the GPU-cached counts (the HBM duplicate factor) --------------------------------------------


async def gpu_truth(backend: Backend) -> CachedCounts:
    """What the backend's block records say is cached on GPU, counted the long way (every
    record read): what `cached_counts` keeps without reading them."""
    d = backend.directory
    if isinstance(d, InMemoryDirectory):
        holders = [sum(m & 1 for m in ws.values()) for ws in d._cached.values()]
    else:
        assert isinstance(d, RedisDirectory)
        records = await d.client.hgetall(d.key("blk"))
        holders = []
        for raw in records.values():
            value = str(raw)  # the client decodes replies
            cached = value[16 : value.index("\n", 16)]  # after the owner's 16 hex digits
            holders.append(sum(ord(c) & 1 for c in cached))
    return CachedCounts(sum(1 for h in holders if h), sum(holders))


async def test_cached_counts_follow_stores_removals_gaps_clears_drops_and_new_roots(
    backend: Backend,
) -> None:
    d = backend.directory

    async def counts() -> tuple[int, int]:
        got = await d.cached_counts()
        assert got == await gpu_truth(backend)
        return got.distinct, got.copies

    assert await counts() == (0, 0)
    for w in ("w1", "w2", "w3"):
        await d.register_worker(w, ROOT, BS)
    await d.apply_events("w1", EventBatch(1, 0.0, (stored([eng(i) for i in range(10)], None, 0),)))
    both = (
        stored([eng(i) for i in range(6)], None, 0),
        stored([eng(i) for i in range(10)], None, 0, Tier.CPU),  # CPU copies: not counted
    )
    await d.apply_events("w2", EventBatch(1, 0.0, both))
    assert await counts() == (10, 16)
    # a block stored twice is still one copy
    await d.apply_events("w2", EventBatch(2, 0.0, (stored([eng(0)], None, 0),)))
    assert await counts() == (10, 16)
    removed = (BlockRemoved((eng(8), eng(9), eng(8))), BlockRemoved((eng(7),), Tier.CPU))
    await d.apply_events("w1", EventBatch(2, 0.0, removed))
    assert await counts() == (8, 14)
    # a gap drops w2's whole view; the batch that shows it stores some again
    gap = (stored([eng(i) for i in range(4)], None, 0),)
    assert (await d.apply_events("w2", EventBatch(7, 0.0, gap))).gap
    assert await counts() == (8, 12)
    await d.apply_events("w3", EventBatch(1, 0.0, (stored([eng(0), eng(1)], None, 0),)))
    assert await counts() == (8, 14)
    await d.apply_events("w1", EventBatch(3, 0.0, (AllBlocksCleared(),)))
    assert await counts() == (4, 6)
    await d.register_worker("w2", chain_root("other-model"), BS)  # a new root: view dropped
    assert await counts() == (2, 2)
    await d.apply_events("w1", EventBatch(4, 0.0, (stored([eng(i) for i in range(5)], None, 0),)))
    assert await counts() == (5, 7)
    if isinstance(d, RedisDirectory):
        await d.drop_worker_steps("w1", step_entries=2)  # the drop's steps, each counted
    else:
        await d.drop_worker("w1")
    assert await counts() == (2, 2)
    await d.drop_worker("w3")
    assert await counts() == (0, 0)


# --- owner death ---------------------------------------------------------------------------------


async def test_drop_worker_ends_everything_it_held(backend: Backend) -> None:
    d = backend.directory
    lease = await d.claim(art(8), "w1", LONG)
    await d.claim(art(12, start=8), "w2", LONG)
    await d.add_replica(CHAIN[7], "w1", Tier.CPU, LONG)
    await d.set_session_owner("s1", "w1", LONG)
    await d.set_session_owner("s2", "w2", LONG)
    await d.register_worker("w1", ROOT, BS)
    await d.apply_events("w1", EventBatch(1, 0.0, (stored([eng(0), eng(1)], None, 0),)))
    dropped = await d.drop_worker("w1")
    assert dropped == 1 + 8 + 2 + 1  # lease, replica blocks, cached blocks, session
    m = await d.lookup(CHAIN[:12], "s1")
    assert m.holdings == (Holding("w2", Tier.GPU, 12, HoldKind.OWNER),)
    assert m.session_owner is None
    assert await d.get_session_owner("s2") == "w2"
    new = await d.claim(art(8), "w3", LONG)
    assert new.worker == "w3" and new.epoch > lease.epoch
    with pytest.raises(StaleEpochError):
        await d.renew(lease.artifact_id, "w1", lease.epoch, LONG)
    assert await d.drop_worker("w1") == 0
    assert await d.drop_worker("never-seen") == 0


# --- transfer (after a state migration) ----------------------------------------------------------


async def session_on_src(d: Directory) -> tuple[Lease, Lease]:
    """A session's prefix on "src" as the router commits it across two turns: a first claim,
    then a fenced delta."""
    base = await d.claim(art(8), "src", LONG)
    delta = await d.claim(art(12, start=8), "src", LONG, fence_epoch=base.epoch)
    assert (base.worker, delta.worker) == ("src", "src")
    return base, delta


async def test_transfer_hands_the_prefix_to_the_destination_at_a_new_epoch(
    backend: Backend,
) -> None:
    d = backend.directory
    base, delta = await session_on_src(d)
    assert await d.transfer(CHAIN[:12], "src", "dst", LONG, LONG, Tier.CPU) == 12
    m = await d.lookup(CHAIN[:16])
    assert m.holdings == (
        Holding("dst", Tier.GPU, 12, HoldKind.OWNER),
        Holding("src", Tier.CPU, 12, HoldKind.REPLICA),
    )
    assert (m.owner, m.owner_blocks, m.owner_artifact_id) == ("dst", 12, CHAIN[11])
    assert m.owner_epoch > delta.epoch > base.epoch
    # both artifacts moved at that epoch; their metadata stays
    for aid, start, n in ((CHAIN[7], 0, 8), (CHAIN[11], 8, 4)):
        info = await d.artifact_info(aid)
        assert info is not None
        assert (info.worker, info.epoch, info.live, info.start, info.blocks) == (
            "dst",
            m.owner_epoch,
            True,
            start,
            n,
        )
    # the source is fenced: renew, release and its next turn's commit are stale
    for aid, old in ((CHAIN[7], base.epoch), (CHAIN[11], delta.epoch)):
        with pytest.raises(StaleEpochError):
            await d.renew(aid, "src", old, LONG)
        with pytest.raises(StaleEpochError):
            await d.release(aid, "src", old)
    with pytest.raises(StaleEpochError):
        await d.claim(art(16, start=12), "src", LONG, fence_epoch=delta.epoch)
    # the destination renews at the new epoch and commits its next turn fenced by it
    renewed = await d.renew(CHAIN[11], "dst", m.owner_epoch, LONG)
    assert (renewed.worker, renewed.epoch) == ("dst", m.owner_epoch)
    nxt = await d.claim(art(16, start=12), "dst", LONG, fence_epoch=m.owner_epoch)
    assert nxt.worker == "dst" and nxt.epoch > m.owner_epoch
    assert (await d.lookup(CHAIN[:16])).owner_blocks == 16
    # ...and can release what it was handed
    await d.release(CHAIN[7], "dst", m.owner_epoch)
    assert (await d.lookup(CHAIN[:8])).owner is None


async def test_transfer_leaves_an_artifact_reaching_past_the_chain_with_the_source(
    backend: Backend,
) -> None:
    d = backend.directory
    base, delta = await session_on_src(d)
    assert await d.transfer(CHAIN[:10], "src", "dst", LONG, LONG) == 8  # the first claim only
    m = await d.lookup(CHAIN[:12])
    assert m.holdings == (
        Holding("dst", Tier.GPU, 8, HoldKind.OWNER),
        Holding("src", Tier.GPU, 12, HoldKind.OWNER),
        Holding("src", Tier.GPU, 10, HoldKind.REPLICA),
    )
    assert (m.owner, m.owner_epoch, m.owner_artifact_id) == ("src", delta.epoch, CHAIN[11])
    assert (await d.renew(CHAIN[11], "src", delta.epoch, LONG)).worker == "src"
    moved = await d.lookup(CHAIN[:8])
    assert (moved.owner, moved.owner_artifact_id) == ("dst", CHAIN[7])
    assert moved.owner_epoch > delta.epoch
    with pytest.raises(StaleEpochError):
        await d.renew(CHAIN[7], "src", base.epoch, LONG)


async def test_transfer_counts_only_the_blocks_that_changed_owner(backend: Backend) -> None:
    d = backend.directory
    other = await d.claim(art(4), "w1", LONG)
    mine = await d.claim(art(8), "src", LONG)  # takes blocks 4-7 only
    assert await d.transfer(CHAIN[:8], "src", "dst", LONG, LONG) == 4
    m = await d.lookup(CHAIN[:8])
    assert m.holdings == (
        Holding("dst", Tier.GPU, 8, HoldKind.OWNER),
        Holding("w1", Tier.GPU, 4, HoldKind.OWNER),
        Holding("src", Tier.GPU, 8, HoldKind.REPLICA),
    )
    assert m.owner_epoch > mine.epoch
    assert (await d.lookup(CHAIN[:4])).owner_epoch == other.epoch  # w1's lease is untouched


async def test_transfer_of_a_prefix_the_source_does_not_own_only_adds_the_replica(
    backend: Backend,
) -> None:
    d = backend.directory
    held = await d.claim(art(8), "w1", LONG)
    gone = await d.claim(art(20, start=16), "src", SHORT)
    await backend.advance(SHORT + 0.1)
    # w1's blocks, and src's whose lease ended: nothing moves
    assert await d.transfer(CHAIN[:20], "src", "dst", LONG, LONG, Tier.SSD) == 0
    m = await d.lookup(CHAIN[:20])
    assert m.holdings == (
        Holding("w1", Tier.GPU, 8, HoldKind.OWNER),
        Holding("src", Tier.SSD, 20, HoldKind.REPLICA),
    )
    assert (m.owner, m.owner_epoch) == ("w1", held.epoch)
    with pytest.raises(StaleEpochError):  # an ended lease does not come back
        await d.renew(gone.artifact_id, "src", gone.epoch, LONG)
    # and no epoch was spent on it
    assert (await d.claim(art(24, start=20), "w1", LONG)).epoch == gone.epoch + 1


async def test_drop_worker_after_a_transfer_follows_the_new_owner(backend: Backend) -> None:
    d = backend.directory
    base, _ = await session_on_src(d)
    await d.transfer(CHAIN[:12], "src", "dst", LONG, LONG)
    epoch = (await d.lookup(CHAIN[:12])).owner_epoch
    assert await d.drop_worker("src") == 12  # its replica of the 12 blocks, not the ownership
    m = await d.lookup(CHAIN[:12])
    assert m.holdings == (Holding("dst", Tier.GPU, 12, HoldKind.OWNER),)
    assert (m.owner, m.owner_epoch) == ("dst", epoch)
    assert await d.drop_worker("dst") == 2  # both artifacts
    assert (await d.lookup(CHAIN[:12])).holdings == ()
    with pytest.raises(StaleEpochError):
        await d.renew(CHAIN[11], "dst", epoch, LONG)
    again = await d.claim(art(8), "w3", LONG)
    assert again.worker == "w3" and again.epoch > epoch > base.epoch


async def test_sweep_after_a_transfer_purges_the_replica_and_the_ended_leases(
    backend: Backend,
) -> None:
    d = backend.directory
    await session_on_src(d)
    await d.transfer(CHAIN[:12], "src", "dst", LONG, SHORT)
    await backend.advance(SHORT + 0.1)
    m = await d.lookup(CHAIN[:12])
    assert m.holdings == (Holding("dst", Tier.GPU, 12, HoldKind.OWNER),)
    assert await d.sweep() == 12  # src's replica lines; the owner's leases live on
    assert await d.drop_worker("src") == 0  # nothing of src is left to undo
    # leases handed over with a short lease expire (and are swept) by that lease
    await d.claim(art(20, start=12), "src", LONG)
    assert await d.transfer(CHAIN[:20], "src", "dst", SHORT, LONG) == 8
    await backend.advance(SHORT + 0.1)
    assert (await d.lookup(CHAIN[:20])).owner_blocks == 12
    assert await d.sweep() == 1
    assert await d.artifact_info(CHAIN[19]) is None
    assert await d.drop_worker("dst") == 2


# --- long chains and bad input -------------------------------------------------------------------


async def test_long_chains_are_one_lookup(backend: Backend) -> None:
    d = backend.directory
    tokens = list(range(5000 * 2))
    chain = tuple(block_hash_chain(tokens, 2, ROOT))  # 5000 blocks: above the Lua chunk size
    await d.claim(Artifact(chain[:4500]), "w1", LONG)
    await d.add_replica(chain[4999], "w2", Tier.CPU, LONG, blocks=chain)
    m = await d.lookup(chain)
    assert (m.owner, m.owner_blocks) == ("w1", 4500)
    assert m.longest("w2", Tier.CPU) == 5000


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.claim(Artifact(()), "w1", LONG),
        lambda d: d.claim(art(4, start=4), "w1", LONG),
        lambda d: d.claim(art(4), "", LONG),
        lambda d: d.claim(art(4), "bad\tname", LONG),
        lambda d: d.claim(art(4), "w1", -1.0),
        lambda d: d.claim(art(4), "w1", float("nan")),
        lambda d: d.set_session_owner("s", "w1", 0),
        lambda d: d.add_replica(CHAIN[0], "w1", Tier.GPU, 0.0),
        lambda d: d.register_worker("w1", ROOT, 0),
        lambda d: d.transfer((), "w1", "w2", LONG, LONG),
        lambda d: d.transfer(CHAIN[:4], "w1", "w1", LONG, LONG),
        lambda d: d.transfer(CHAIN[:4], "w1", "", LONG, LONG),
        lambda d: d.transfer(CHAIN[:4], "bad\nname", "w2", LONG, LONG),
        lambda d: d.transfer(CHAIN[:4], "w1", "w2", 0.0, LONG),
        lambda d: d.transfer(CHAIN[:4], "w1", "w2", LONG, float("inf")),
    ],
)
async def test_bad_input_is_an_invalid_request(backend: Backend, call) -> None:
    with pytest.raises(InvalidRequestError):
        await call(backend.directory)


async def test_health_reports_the_backend(backend: Backend) -> None:
    h = await backend.directory.health()
    assert h.healthy and h.backend == backend.name
