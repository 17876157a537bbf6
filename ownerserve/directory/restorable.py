"""Restorable units: per prefix boundary, which KV cache groups a worker holds and in which tier,
from the group-tagged KV events of an engine serving a hybrid-attention model (vLLM tags each
KV cache group's BlockStored/BlockRemoved with `group_idx`, `kv_cache_spec_kind` and the
window).

The directory's chain index takes only the attention chain: events without a group (a
single-group engine, as before) and those of the chain group, the lowest-numbered group whose
kind is attention (full, MLA, compressed). Every other group's events — sliding windows,
per-sequence state, Mamba, further attention groups — land here instead (`GroupHoldings.split`),
so a window block dropped past its window never removes an attention block from the chain, and
a state group's hashes never extend it. Sliding-window and state groups hold only the
boundaries their engine retains: a prefix is restorable at boundary k when every attention
group holds blocks [0, k) and every window group the last ceil(window / block size) blocks
before k (a state group the block before k). `restorable(worker, chain)` answers that per tier,
with the deepest boundary the attention groups alone reach (restorable by rebuilding the
windows there). Kept in process by each directory (a router replica learns it from the events
it applies); pure logic, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from ownerserve.hashing import block_hash_chain, hash_block
from ownerserve.types import Tier

if TYPE_CHECKING:
    from ownerserve.directory.base import Match

ATTENTION_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "compressed_attention"}
)
"""Group kinds whose blocks cover every token of a prefix (sealed, chain-shaped)."""
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})
"""Group kinds that hold only the last `window` tokens' entries at a boundary."""
ENGINE_MAP_LIMIT = 1_000_000
"""Past this many engine hashes a worker's map keeps only those some group still holds."""


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One KV cache group of a worker as its events describe it."""

    index: int
    kind: str
    window: int | None = None

    @property
    def attention(self) -> bool:
        return self.kind in ATTENTION_KINDS or self.kind == "compressed_indexer"

    def span_blocks(self, block_size: int) -> int:
        """Blocks before a boundary the group needs to restore it (0: every block)."""
        if self.attention:
            return 0
        if self.kind in WINDOW_KINDS and self.window:
            return -(-self.window // block_size)
        return 1  # state groups (and windows of unknown size): the block before the boundary


@dataclass(frozen=True, slots=True)
class RestorableUnit:
    """What `worker` can restore of a looked-up chain from `tier`: every group down to
    boundary `blocks`, the attention groups alone down to `sealed_blocks` (past `blocks`
    the windows must be rebuilt)."""

    worker: str
    tier: Tier
    blocks: int
    sealed_blocks: int
    groups: int
    """How many KV cache groups the worker's events named."""


@dataclass(slots=True)
class _Worker:
    root: int | None = None
    """None until the worker registers: group events are then only sorted, not recorded."""
    block_size: int = 0
    chain_group: int | None = None
    groups: dict[int, GroupInfo] = field(default_factory=dict)
    engine_map: dict[int, int] = field(default_factory=dict)
    """Engine block hash -> OwnerServe chain hash, for every group's stored blocks."""
    held: dict[tuple[int, Tier], set[int]] = field(default_factory=dict)
    """(group, tier) -> chain hashes held."""


class GroupHoldings:
    """Per worker, the KV cache groups holding each block of a prefix, in which tier."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._any = False  # some worker's events named a group: lookups pay only then

    def register_worker(self, worker: str, root: int, block_size: int) -> None:
        """The chain root and block size the worker's events use (as the directory's)."""
        old = self._workers.get(worker)
        if old is None or old.root is None:
            rec = old or _Worker()
            rec.root, rec.block_size = root, block_size
            self._workers[worker] = rec
        elif (old.root, old.block_size) != (root, block_size):
            self._workers[worker] = _Worker(root, block_size)

    def drop_worker(self, worker: str) -> None:
        """Forget what the worker holds (it died or left); its registration stays."""
        rec = self._workers.get(worker)
        if rec is not None:
            self._workers[worker] = _Worker(rec.root, rec.block_size)

    def has_groups(self, worker: str) -> bool:
        rec = self._workers.get(worker)
        return rec is not None and bool(rec.groups)

    @property
    def any_groups(self) -> bool:
        """Whether any worker's events named a KV cache group (one attribute read: every
        lookup asks)."""
        return self._any

    # --- events ------------------------------------------------------------------------------

    def split(self, worker: str, batch: EventBatch) -> EventBatch:
        """The batch the chain index takes: untagged events and the chain group's, in order;
        every group's events are recorded here. A batch without group tags is returned as it
        is (nothing recorded)."""
        events = batch.events
        if not any(
            isinstance(e, BlockStored | BlockRemoved) and e.group_idx is not None for e in events
        ):
            if any(isinstance(e, AllBlocksCleared) for e in events):
                self.clear(worker)
            return batch
        rec = self._workers.get(worker)
        if rec is None:
            rec = self._workers[worker] = _Worker()
        if rec.root is not None:
            # An attention group stores every block it caches, a window group only those its
            # retention keeps; the attention groups' stores of this step map the engine hashes
            # a window group's store names before that store is read (vLLM publishes the
            # window groups' first).
            for e in events:
                if isinstance(e, BlockStored) and e.group_kind in ATTENTION_KINDS:
                    _place(rec, e)
        chain: list[KVEvent] = []
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.clear(worker)
                chain.append(e)
                continue
            if e.group_idx is None:
                chain.append(e)
                continue
            self._record(rec, e)
            if rec.chain_group == e.group_idx:
                chain.append(self._untagged(e))
        return EventBatch(batch.seq, batch.ts, tuple(chain))

    @staticmethod
    def _untagged(e: BlockStored | BlockRemoved) -> KVEvent:
        if isinstance(e, BlockStored):
            return BlockStored(
                e.engine_hashes, e.parent_engine_hash, e.token_ids, e.block_size, e.tier, e.lora_id
            )
        return BlockRemoved(e.engine_hashes, e.tier)

    def _record(self, rec: _Worker, e: BlockStored | BlockRemoved) -> None:
        g = e.group_idx
        assert g is not None
        if isinstance(e, BlockStored) and g not in rec.groups:
            info = GroupInfo(g, e.group_kind or "full_attention", e.sliding_window)
            rec.groups[g] = info
            self._any = True
            if info.kind in ATTENTION_KINDS and (rec.chain_group is None or g < rec.chain_group):
                rec.chain_group = g
        if rec.root is None:
            return
        held = rec.held.setdefault((g, e.tier), set())
        if isinstance(e, BlockRemoved):
            for eh in e.engine_hashes:
                h = rec.engine_map.get(eh)
                if h is not None:
                    held.discard(h)
            return
        if len(rec.engine_map) > ENGINE_MAP_LIMIT:
            _prune(rec)
        held.update(_place(rec, e))

    def clear(self, worker: str) -> None:
        """The worker dropped its cache (or its events were lost): nothing is held."""
        rec = self._workers.get(worker)
        if rec is not None:
            rec.held.clear()
            rec.engine_map.clear()

    # --- lookups -----------------------------------------------------------------------------

    def groups_of(self, worker: str) -> tuple[GroupInfo, ...]:
        """The worker's KV cache groups as its events named them, by index."""
        rec = self._workers.get(worker)
        return () if rec is None else tuple(rec.groups[g] for g in sorted(rec.groups))

    def held_blocks(
        self, worker: str, group: int, chain: Sequence[int], tier: Tier = Tier.GPU
    ) -> tuple[bool, ...]:
        """Per block of `chain`, whether the worker's group `group` holds it in `tier`."""
        rec = self._workers.get(worker)
        held = set() if rec is None else rec.held.get((group, tier), set())
        return tuple(h in held for h in chain)

    def restorable(self, worker: str, chain: Sequence[int]) -> list[RestorableUnit]:
        """Per tier where the worker holds any of `chain`, how deep it can restore it."""
        rec = self._workers.get(worker)
        if rec is None or not rec.groups:
            return []
        out: list[RestorableUnit] = []
        tiers = sorted({t for (_g, t) in rec.held}, key=lambda t: t.value)
        for tier in tiers:
            sealed = len(chain)
            spans: list[tuple[set[int], int]] = []
            for g, info in rec.groups.items():
                held = rec.held.get((g, tier), set())
                span = info.span_blocks(rec.block_size)
                if span == 0:
                    n = 0
                    while n < sealed and chain[n] in held:
                        n += 1
                    sealed = n
                else:
                    spans.append((held, span))
            if not sealed:
                continue
            blocks = _deepest(chain, sealed, spans)
            out.append(RestorableUnit(worker, tier, blocks, sealed, len(rec.groups)))
        return out

    def restorable_all(self, chain: Sequence[int]) -> tuple[RestorableUnit, ...]:
        """`restorable` for every worker with group-tagged events."""
        out: list[RestorableUnit] = []
        for worker in self._workers:
            out.extend(self.restorable(worker, chain))
        return tuple(out)


def annotate(groups: GroupHoldings, match: Match, chain: Sequence[int]) -> Match:
    """`match` with what every worker with group-tagged events can restore of `chain` (the
    same `match` when no worker has them: a dense deployment pays nothing)."""
    if not groups.any_groups or not chain:
        return match
    units = groups.restorable_all(chain)
    return dataclasses.replace(match, restorable=units) if units else match


def _place(rec: _Worker, e: BlockStored) -> list[int]:
    """The chain hashes of the blocks `e` stores, learning their engine hashes.

    A store names one engine hash per block of its token range, in order; or, from a window
    group, only the blocks its retention kept of that range (vLLM 0.32's `cache_full_blocks`
    skips the blocks the window or the retention interval dropped, keeping the range's tokens
    and its parent). Those are placed by the engine hashes the attention groups' stores mapped,
    else as the range's last blocks (the window drops the leading ones), without learning
    them. A store that fits neither, or whose parent was never seen, is not placed (the
    directory counts such stores as skipped)."""
    bs = rec.block_size
    n = len(e.engine_hashes)
    if e.block_size != bs or not n or len(e.token_ids) % bs or len(e.token_ids) < bs * n:
        return []
    parent: int | None = (
        rec.root if e.parent_engine_hash is None else rec.engine_map.get(e.parent_engine_hash)
    )
    span = len(e.token_ids) // bs
    if n < span:
        known = [rec.engine_map.get(eh) for eh in e.engine_hashes]
        if all(h is not None for h in known):
            return [h for h in known if h is not None]
        if parent is None:
            return []
        hashes = block_hash_chain(e.token_ids, bs, parent)
        return [h if h is not None else hashes[span - n + k] for k, h in enumerate(known)]
    out: list[int] = []
    for k, eh in enumerate(e.engine_hashes):
        h = rec.engine_map.get(eh)
        if h is None:
            if parent is None:
                break  # a parent never seen: the rest cannot be placed on the chain
            h = hash_block(parent, e.token_ids[k * bs : (k + 1) * bs])
            rec.engine_map[eh] = h
        out.append(h)
        parent = h
    return out


def _prune(rec: _Worker) -> None:
    """Forget the engine hashes of blocks no group holds any more (a parent of a later store
    may be among them: that store is then not placed, as the directory skips it too)."""
    live: set[int] = set().union(*rec.held.values()) if rec.held else set()
    rec.engine_map = {eh: h for eh, h in rec.engine_map.items() if h in live}


def _deepest(chain: Sequence[int], sealed: int, spans: list[tuple[set[int], int]]) -> int:
    """The deepest boundary k <= `sealed` where every (held, span) group holds the `span`
    blocks before k (fewer at the start of the chain); 0 if none."""
    if not spans:
        return sealed
    runs: list[list[int]] = []
    for held, _span in spans:
        run = [0] * sealed
        r = 0
        for j in range(sealed):
            r = r + 1 if chain[j] in held else 0
            run[j] = r
        runs.append(run)
    for k in range(sealed, 0, -1):
        if all(run[k - 1] >= min(span, k) for run, (_h, span) in zip(runs, spans, strict=True)):
            return k
    return 0
