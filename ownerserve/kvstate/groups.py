"""A spec's KV cache groups: layers that share one kind of cache entry, one block table and one
update rule, as vLLM's hybrid KV cache manager groups them (one block pool per KV cache group:
full attention, sliding window, compressed, indexer, per-sequence state).

`kv_cache_groups(spec, block_tokens)` derives the groups of a `KVStateSpec` without I/O; each
group answers how many bytes a prefix of n tokens holds in it (the per-type sizes of
`KVStateSpec.state_bytes`, split by group), how big one of its cache blocks is, and whether its
blocks are sealed at the block's boundary (immutable, shareable) or are mutable session state
that only some boundaries keep (`ownerserve.kvstate.retention`).

Group order: sealed groups first (per-token full attention, then compressed, then indexer, by
ratio), then sliding-window groups, then per-sequence state groups; group 0 is the one whose
block hashes chain the prefix (the attention chain every KV event consumer indexes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ownerserve.kvstate.spec import KVStateSpec, LayerSpec
from ownerserve.kvstate.types import AttentionType, StateType


class GroupKind(StrEnum):
    """What a group's cache entries are (values as vLLM's `kv_cache_spec_kind` where it has
    one)."""

    FULL = "full_attention"
    """One entry per token (dense attention, MLA latents)."""
    COMPRESSED = "compressed_attention"
    """One entry per `ratio` tokens (CSA main KV, HCA)."""
    INDEXER = "compressed_indexer"
    """One indexer key per `ratio` tokens (CSA's lightning indexer)."""
    SLIDING_WINDOW = "sliding_window"
    """The last `window` uncompressed entries: blocks past the window are freed."""
    STATE = "state"
    """A per-sequence state of fixed size (compression tails, recurrent state)."""


_SEALED_KINDS = frozenset({GroupKind.FULL, GroupKind.COMPRESSED, GroupKind.INDEXER})
_ORDER = {
    GroupKind.FULL: 0,
    GroupKind.COMPRESSED: 1,
    GroupKind.INDEXER: 2,
    GroupKind.SLIDING_WINDOW: 3,
    GroupKind.STATE: 4,
}


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV cache group: `layers` layers whose entries are `entry_bytes` each.

    `ratio` original tokens make one entry (1 but for compressed and indexer groups; for a
    state group the compression ratio whose pending tokens it keeps, `overlap` when the
    compressor also keeps the previous group); `window` is the sliding window in tokens;
    `block_tokens` original tokens make one cache block.
    """

    index: int
    kind: GroupKind
    state_type: StateType
    layers: int
    entry_bytes: int
    block_tokens: int
    ratio: int = 1
    window: int = 0
    overlap: bool = False

    @property
    def sealed(self) -> bool:
        """Whether a complete block of this group never changes (a shareable artifact)."""
        return self.kind in _SEALED_KINDS

    @property
    def vllm_kind(self) -> str:
        """The group's `kv_cache_spec_kind` in KV events."""
        return self.kind.value

    def entries(self, n: int) -> int:
        """Entries one layer of this group holds for a prefix of n tokens."""
        if n < 0:
            raise ValueError(f"negative token count {n}")
        if self.kind is GroupKind.SLIDING_WINDOW:
            return min(self.window, n)
        if self.kind is GroupKind.STATE:
            m = self.ratio
            return n % m + (m if self.overlap and n >= m else 0)
        return n // self.ratio

    def bytes(self, n: int) -> int:
        """Bytes the group holds for a prefix of n tokens, over all its layers."""
        return self.layers * self.entries(n) * self.entry_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one cache block over all layers: `block_tokens / ratio` entries of a
        sealed group, `block_tokens` window entries, or a state group's largest state."""
        if self.kind is GroupKind.STATE:
            m = self.ratio
            most = m - 1 + (m if self.overlap else 0)
            return self.layers * most * self.entry_bytes
        return self.layers * (self.block_tokens // self.ratio) * self.entry_bytes

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group needs to hold its window at a block boundary."""
        if self.kind is not GroupKind.SLIDING_WINDOW:
            return 0
        return -(-self.window // self.block_tokens)


def _layer_groups(layer: LayerSpec, count: int, block_tokens: int) -> list[KVCacheGroup]:
    out: list[KVCacheGroup] = []

    def add(
        kind: GroupKind,
        st: StateType,
        entry: int,
        ratio: int = 1,
        window: int = 0,
        overlap: bool = False,
    ) -> None:
        out.append(KVCacheGroup(-1, kind, st, count, entry, block_tokens, ratio, window, overlap))

    att = layer.attention
    if att in (AttentionType.DENSE, AttentionType.MLA):
        add(GroupKind.FULL, StateType.DENSE_KV, layer.entry_bytes)
    elif att is AttentionType.CSA:
        m = layer.compress_ratio
        add(GroupKind.COMPRESSED, StateType.COMPRESSED_CSA_MAIN, layer.entry_bytes, ratio=m)
        add(GroupKind.INDEXER, StateType.COMPRESSED_CSA_INDEX, layer.index_entry_bytes, ratio=m)
    elif att is AttentionType.HCA:
        add(
            GroupKind.COMPRESSED,
            StateType.COMPRESSED_HCA,
            layer.entry_bytes,
            ratio=layer.compress_ratio,
        )
    if layer.window > 0:
        add(
            GroupKind.SLIDING_WINDOW,
            StateType.WINDOW_SWA,
            layer.window_entry_bytes,
            window=layer.window,
        )
    if StateType.TAIL_STATE in layer.state_types():
        add(
            GroupKind.STATE,
            StateType.TAIL_STATE,
            layer.tail_token_bytes,
            ratio=layer.compress_ratio,
            overlap=layer.compress_overlap,
        )
    return out


def kv_cache_groups(spec: KVStateSpec, block_tokens: int | None = None) -> tuple[KVCacheGroup, ...]:
    """The spec's KV cache groups for cache blocks of `block_tokens` tokens (default: the
    spec's `block_tokens`; an engine's block size must be a multiple of it, so that every
    block ends on a boundary of every compression ratio).

    Layers whose groups differ only in layer count are one group (a window of the same size
    and entry over CSA and HCA layers is one sliding-window group)."""
    bt = spec.block_tokens if block_tokens is None else block_tokens
    if bt <= 0 or bt % spec.block_tokens:
        raise ValueError(
            f"spec {spec.name!r}: a cache block of {bt} tokens must be a positive multiple of "
            f"the spec's block_tokens {spec.block_tokens} (lcm of its compression ratios)"
        )
    merged: dict[tuple[object, ...], KVCacheGroup] = {}
    for g in spec.groups:
        for grp in _layer_groups(g.layer, g.count, bt):
            key = (grp.kind, grp.state_type, grp.entry_bytes, grp.ratio, grp.window, grp.overlap)
            old = merged.get(key)
            if old is None:
                merged[key] = grp
            else:
                merged[key] = KVCacheGroup(
                    -1, old.kind, old.state_type, old.layers + grp.layers, old.entry_bytes,
                    bt, old.ratio, old.window, old.overlap,
                )  # fmt: skip
    ordered = sorted(merged.values(), key=lambda x: (_ORDER[x.kind], x.ratio, x.window))
    return tuple(
        KVCacheGroup(i, x.kind, x.state_type, x.layers, x.entry_bytes, bt, x.ratio, x.window,
                     x.overlap)
        for i, x in enumerate(ordered)
    )  # fmt: skip


def bytes_by_state_type(groups: tuple[KVCacheGroup, ...], n: int) -> dict[StateType, int]:
    """Bytes each state type holds for a prefix of n tokens, summed over the groups (equals
    `KVStateSpec.state_bytes(0, n)`)."""
    out: dict[StateType, int] = {}
    for g in groups:
        out[g.state_type] = out.get(g.state_type, 0) + g.bytes(n)
    return out


def sealed_block_bytes(groups: tuple[KVCacheGroup, ...]) -> int:
    """Bytes one cache block takes in every sealed group together (one block of the prefix)."""
    return sum(g.block_bytes for g in groups if g.sealed)


def is_hybrid(groups: tuple[KVCacheGroup, ...]) -> bool:
    """Whether the groups are more than one full-attention group (a dense model's cache)."""
    return not (len(groups) == 1 and groups[0].kind is GroupKind.FULL)
