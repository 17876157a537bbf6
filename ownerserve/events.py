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


@fast_init
@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from a worker's tier."""

    engine_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU


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
