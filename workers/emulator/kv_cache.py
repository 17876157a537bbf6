"""The paged KV cache of an emulated engine: fixed-size blocks, prefix caching, LRU eviction, and
an optional CPU tier behind it (`HostPool`, vLLM's KV offloading).

Modelled on vLLM's block pool. A block is a slot of `block_size` tokens. A full block that has
been computed is *cached* under its chained hash (`ownerserve.hashing`), so a later request with
the same prefix reuses it. Running requests hold references; a block with no references stays
cached in a free queue and is evicted, least recently freed first, only when a new block is
needed. Every store and eviction is recorded as a KV event (`ownerserve.events`) that the engine
drains and publishes once per step. Pure logic: no I/O, no clock.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from ownerserve.types import Tier


def prompt_block_hashes(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """`ownerserve.hashing.block_hash_chain(tokens, block_size, root)`, hashed in place over one
    packed buffer instead of one conversion per block (same hashes, a third of the time)."""
    n_blocks = len(tokens) // block_size
    if n_blocks <= 0:
        return []
    packed = array("I", tokens[: n_blocks * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    buf = memoryview(packed).cast("B")
    step = 4 * block_size
    parent = root
    out: list[int] = []
    for i in range(0, n_blocks * step, step):
        parent = xxh3_64_intdigest(buf[i : i + step], parent)
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a cached block holds, as another worker needs it to insert a copy."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NewBlock:
    """A block to register in the cache: where it lives and what it holds."""

    block_id: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


def _leading(hashes: Sequence[int], held: Container[int]) -> int:
    """How many leading hashes of `hashes` are in `held`."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class _Blocks:
    """What both tiers have: a size in blocks, an eviction count, the KV events recorded."""

    __slots__ = ("_events", "block_size", "evicted_blocks", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.evicted_blocks = 0
        self._events: list[KVEvent] = []

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last drain, in order."""
        events, self._events = self._events, []
        return events


class BlockPool(_Blocks):
    """`num_blocks` KV blocks with reference counts, a hash index and an LRU free queue."""

    __slots__ = ("_by_hash", "_free", "_hash", "_parent", "_ref", "_tokens", "tier")

    def __init__(self, num_blocks: int, block_size: int, tier: Tier = Tier.GPU) -> None:
        super().__init__(num_blocks, block_size)
        self.tier = tier
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Free blocks in eviction order: the first is reused next. Uncached blocks go to the
        # front (nothing to lose), cached ones to the back (most recently used last).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # --- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no references (empty or cached-but-unused), all allocatable."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix hash (resident KV)."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain `hashes` are cached."""
        return _leading(hashes, self._by_hash)

    def free_after_touch(self, hashes: Sequence[int]) -> int:
        """Free blocks left once the cached blocks `hashes` are referenced."""
        idle = sum(1 for h in hashes if self._ref[self._by_hash[h]] == 0)
        return len(self._free) - idle

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    def read(self, hashes: Sequence[int]) -> list[CachedBlock | None]:
        """The cached blocks for `hashes` (None where not cached); marks them recently used."""
        out: list[CachedBlock | None] = []
        for h in hashes:
            bid = self._by_hash.get(h)
            if bid is None:
                out.append(None)
                continue
            if bid in self._free:
                self._free.move_to_end(bid)
            out.append(CachedBlock(h, self._parent[bid], self._tokens[bid]))
        return out

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # --- references ----------------------------------------------------------------------------

    def touch(self, hashes: Sequence[int]) -> list[int]:
        """Reference the cached blocks `hashes` (all must be cached); returns their block ids."""
        ids: list[int] = []
        for h in hashes:
            bid = self._by_hash[h]
            if self._ref[bid] == 0:
                del self._free[bid]
            self._ref[bid] += 1
            ids.append(bid)
        return ids

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh referenced blocks, evicting cached ones as needed; None if too few free."""
        if n > len(self._free):
            return None
        ids: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            bid, _unused = self._free.popitem(last=False)
            h = self._hash[bid]
            if h is not None:
                del self._by_hash[h]
                self._hash[bid] = None
                self._parent[bid] = None
                self._tokens[bid] = ()
                removed.append(h)
            self._ref[bid] = 1
            ids.append(bid)
        if removed:
            self.evicted_blocks += len(removed)
            self._events.append(BlockRemoved(engine_hashes=tuple(removed), tier=self.tier))
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, the chain's tail first (evicted first)."""
        for bid in reversed(block_ids):
            ref = self._ref[bid] - 1
            if ref < 0:
                raise ValueError(f"block {bid} freed more often than referenced")
            self._ref[bid] = ref
            if ref == 0:
                self._free[bid] = None
                if self._hash[bid] is None:
                    self._free.move_to_end(bid, last=False)

    def discard(self, block_ids: Sequence[int]) -> None:
        """`free`, but a block whose last reference goes is dropped from the cache too (a
        window block no retained boundary needs), recorded as one BlockRemoved."""
        removed: list[int] = []
        for bid in reversed(block_ids):
            ref = self._ref[bid] - 1
            if ref < 0:
                raise ValueError(f"block {bid} freed more often than referenced")
            self._ref[bid] = ref
            if ref:
                continue
            h = self._hash[bid]
            if h is not None:
                del self._by_hash[h]
                self._hash[bid] = None
                self._parent[bid] = None
                self._tokens[bid] = ()
                removed.append(h)
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)
        if removed:
            self._events.append(BlockRemoved(engine_hashes=tuple(removed), tier=self.tier))

    # --- caching -------------------------------------------------------------------------------

    def register(self, blocks: Sequence[NewBlock]) -> list[int]:
        """Cache computed full blocks under their hashes; returns the hashes newly stored.

        A hash already cached in another block is left alone (this block stays a private
        duplicate, as in vLLM). Each run of consecutive new blocks becomes one BlockStored.
        """
        stored: list[int] = []
        run: list[NewBlock] = []
        for b in blocks:
            if b.block_hash in self._by_hash or self._hash[b.block_id] is not None:
                self._emit_stored(run)
                run = []
                continue
            self._by_hash[b.block_hash] = b.block_id
            self._hash[b.block_id] = b.block_hash
            self._parent[b.block_id] = b.parent_hash
            self._tokens[b.block_id] = b.token_ids
            stored.append(b.block_hash)
            if run and run[-1].block_hash != b.parent_hash:
                self._emit_stored(run)
                run = []
            run.append(b)
        self._emit_stored(run)
        return stored

    def _emit_stored(self, run: list[NewBlock]) -> None:
        if not run:
            return
        tokens: list[int] = []
        for b in run:
            tokens.extend(b.token_ids)
        self._events.append(
            BlockStored(
                engine_hashes=tuple(b.block_hash for b in run),
                parent_engine_hash=run[0].parent_hash,
                token_ids=tuple(tokens),
                block_size=self.block_size,
                tier=self.tier,
            )
        )

    def insert(self, blocks: Sequence[CachedBlock]) -> list[int]:
        """Copy blocks received from another worker into the cache, referenced by the caller.

        Blocks already cached are referenced instead of copied. Stops at the first block that
        finds no free slot; returns the block ids of the inserted prefix of `blocks`.
        """
        ids: list[int] = []
        new: list[NewBlock] = []
        for b in blocks:
            bid = self._by_hash.get(b.block_hash)
            if bid is not None:
                ids.extend(self.touch([b.block_hash]))
                continue
            got = self.allocate(1)
            if got is None:
                break
            ids.append(got[0])
            new.append(NewBlock(got[0], b.block_hash, b.parent_hash, b.token_ids))
        self.register(new)
        return ids

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's reset_prefix_cache); False while blocks are in use."""
        if len(self._free) != self.num_blocks:
            return False
        for bid in range(self.num_blocks):
            self._hash[bid] = None
            self._parent[bid] = None
            self._tokens[bid] = ()
        self._by_hash.clear()
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._events.append(AllBlocksCleared())
        return True


class HostPool(_Blocks):
    """The CPU tier behind HBM: vLLM's KV offloading (`OffloadingConnector` with the native
    `CPUOffloadingManager` and its `LRUCachePolicy`), one chunk per block (`blocks_per_chunk`
    1, the default), `num_blocks` chunks in all.

    Write-through, as vLLM's connector stores: computed prompt blocks are offered as they are
    computed (`store`), not when HBM evicts them. An offer keeps the blocks already here and
    takes a slot for each new one, evicting the least recently used blocks that are neither
    being loaded (`pin`) nor part of the offer; when that cannot make room the whole offer is
    refused (vLLM's `prepare_store` returning None) and is made again later. Recency, as
    vLLM's LRU policy keeps it: a block is used when stored and when a request that stored or
    loaded it finishes (`touch`, the prefix last so it goes last). Stores and evictions are
    recorded as KV events with the CPU tier (medium "CPU"), one BlockStored per block with its
    own parent as vLLM's self-describing offloading events carry them.
    """

    __slots__ = ("_blocks", "_pinned", "store_failures", "stored_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.stored_blocks = 0
        self.store_failures = 0
        # Resident blocks in eviction order: the first is evicted next.
        self._blocks: OrderedDict[int, CachedBlock] = OrderedDict()
        self._pinned: dict[int, int] = {}  # block hash -> loads in flight

    @property
    def num_cached(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks being transferred (vLLM's kv_offload_cpu_cache_usage_perc
        counts chunks with a load or store in flight; stores here complete at once)."""
        return len(self._pinned) / self.num_blocks

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def cached_hashes(self) -> list[int]:
        return list(self._blocks)

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain `hashes` are here."""
        return _leading(hashes, self._blocks)

    def store(self, blocks: Sequence[CachedBlock]) -> bool:
        """Offer computed blocks, in chain order; False (nothing stored) when the new ones
        cannot all get a slot."""
        resident = self._blocks
        new = [b for b in blocks if b.block_hash not in resident]
        if not new:
            return True
        evict = len(resident) + len(new) - self.num_blocks
        victims: list[int] = []
        if len(new) > self.num_blocks:
            self.store_failures += 1
            return False
        if evict > 0:
            offered = {b.block_hash for b in blocks}
            for h in resident:
                if h not in self._pinned and h not in offered:
                    victims.append(h)
                    if len(victims) == evict:
                        break
            if len(victims) < evict:
                self.store_failures += 1
                return False
            for h in victims:
                del resident[h]
            self.evicted_blocks += len(victims)
            self._events.append(BlockRemoved(engine_hashes=tuple(victims), tier=Tier.CPU))
        for b in new:
            resident[b.block_hash] = b
            self._events.append(
                BlockStored(
                    engine_hashes=(b.block_hash,),
                    parent_engine_hash=b.parent_hash,
                    token_ids=b.token_ids,
                    block_size=self.block_size,
                    tier=Tier.CPU,
                )
            )
        self.stored_blocks += len(new)
        return True

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark the blocks `hashes` used, the first most recently (absent ones are skipped)."""
        resident = self._blocks
        for h in reversed(hashes):
            if h in resident:
                resident.move_to_end(h)

    def pin(self, hashes: Sequence[int]) -> None:
        """Keep the blocks `hashes` (all here) from eviction while they are loaded."""
        for h in hashes:
            if h not in self._blocks:
                raise KeyError(f"block {h:#x} is not in the CPU tier")
            self._pinned[h] = self._pinned.get(h, 0) + 1

    def unpin(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            n = self._pinned.get(h, 0) - 1
            if n > 0:
                self._pinned[h] = n
            else:
                self._pinned.pop(h, None)

    def reset(self) -> None:
        """Drop every block (vLLM's reset_prefix_cache with reset_external: no events)."""
        self._blocks.clear()
        self._pinned.clear()
