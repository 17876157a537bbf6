"""KV cache events as the directory consumes them, independent of the wire format.

Mirrors vLLM's KV event stream (BlockStored / BlockRemoved / AllBlocksCleared, in sequenced
batches). `engine_hashes` are the worker's own block hashes (opaque to us); `token_ids` let the
directory rebuild OwnerServe's chained hashes (`ownerserve.hashing`). vLLM's wire codec:
`ownerserve/vllm_events.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ownerserve.records import fast_init
from ownerserve.types import Tier


@fast_init
@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became resident on a worker; `parent_engine_hash` is None at a chain start."""

    engine_hashes: tuple[int, ...]
    parent_engine_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: Tier = Tier.GPU
    lora_id: int | None = None
    group_idx: int | None = None
    """The KV cache group the blocks belong to (vLLM tags each group's events); None: a
    single-group engine (dense attention), the same as group 0."""
    group_kind: str | None = None
    """The group's `kv_cache_spec_kind` (`full_attention`, `sliding_window`, ...)."""
    sliding_window: int | None = None
    """A sliding-window group's window in tokens (`kv_cache_spec_sliding_window`)."""


@fast_init
@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from a worker's tier."""

    engine_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU
    group_idx: int | None = None
    """The KV cache group the blocks left (None: a single-group engine)."""


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole cache (restart, reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: a per-worker monotonically increasing `seq` enables gap detection."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
