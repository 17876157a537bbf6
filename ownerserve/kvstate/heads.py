"""Per-KV-head artifact keys, so that producers and consumers with different TP sizes share KV.

A key names one KV head (not one TP rank) of one chunk, so an artifact's identity does not
depend on the TP size that wrote it (vLLM-Ascend's KV pool layout, head for TP rank)::

    {model}@pcp{pcp}@dcp{dcp}@head:{head}@pp_rank:{pp}@{chunk_hash}[@layers:{a}-{b}][@{layer}][@{state}]

A pipeline-parallel producer holds only its stage's layers; `layers=(a, b)` names the model
layers `[a, b)` its artifact holds, so stages split differently never share a key (a PP=1
producer, holding every layer, leaves it unset: its keys are those written before PP existed).

`heads_for_rank` maps (TP size, rank) to the global KV heads that rank holds; when TP exceeds
the number of KV heads each head is replicated over TP/heads ranks, as vLLM does, and only the
first replica stores it (`store_heads_for_rank`). MLA and shared-KV compressed attention keep
one head, so every rank holds (and needs) head 0. A lookup reports a chunk present only if
every head (and pipeline stage) a consumer needs is present.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ownerserve.kvstate.types import StateType


def heads_for_rank(kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """Global KV head indices that TP rank `tp_rank` of `tp_size` holds."""
    if kv_heads <= 0 or tp_size <= 0:
        raise ValueError("kv_heads and tp_size must be positive")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    if tp_size <= kv_heads:
        if kv_heads % tp_size:
            raise ValueError(f"{kv_heads} KV heads cannot be split over TP={tp_size}")
        per = kv_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % kv_heads:
        raise ValueError(f"TP={tp_size} is not a multiple of {kv_heads} KV heads")
    return (tp_rank // (tp_size // kv_heads),)


def store_heads_for_rank(kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """Heads this rank writes: its own heads, or none if it is not a head's first replica."""
    if tp_size > kv_heads and tp_rank % (tp_size // kv_heads):
        return ()
    return heads_for_rank(kv_heads, tp_size, tp_rank)


@dataclass(frozen=True, slots=True)
class HeadArtifactKey:
    """The storage key of one KV head's slice of one chunk (optionally one layer, one type)."""

    model: str
    head: int
    chunk_hash: int
    pp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    layer: int | None = None
    state: StateType | None = None
    layers: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers must be a non-empty range [a, b), got {self.layers}")

    def to_string(self) -> str:
        s = (
            f"{self.model}@pcp{self.pcp_rank}@dcp{self.dcp_rank}@head:{self.head}"
            f"@pp_rank:{self.pp_rank}@{self.chunk_hash:016x}"
        )
        if self.layers is not None:
            s += f"@layers:{self.layers[0]}-{self.layers[1]}"
        if self.layer is not None:
            s += f"@{self.layer}"
        if self.state is not None:
            s += f"@{self.state.value}"
        return s

    def split_layers(self, num_layers: int) -> list[HeadArtifactKey]:
        """The per-layer keys of this head and chunk (layer-wise transfer)."""
        return [
            HeadArtifactKey(
                self.model,
                self.head,
                self.chunk_hash,
                self.pp_rank,
                self.pcp_rank,
                self.dcp_rank,
                layer,
                self.state,
                self.layers,
            )
            for layer in range(num_layers)
        ]


def head_keys(
    model: str,
    chunk_hash: int,
    heads: Iterable[int],
    *,
    pp_ranks: Iterable[int] = (0,),
    state: StateType | None = None,
) -> list[str]:
    """Keys of `heads` of one chunk over the given pipeline stages."""
    pps = tuple(pp_ranks)
    return [
        HeadArtifactKey(model, h, chunk_hash, pp, state=state).to_string()
        for h in heads
        for pp in pps
    ]


def store_keys_for_rank(
    model: str,
    chunk_hashes: Sequence[int],
    kv_heads: int,
    tp_size: int,
    tp_rank: int,
    *,
    pp_rank: int = 0,
) -> list[str]:
    """Every key a producer rank writes for `chunk_hashes`."""
    heads = store_heads_for_rank(kv_heads, tp_size, tp_rank)
    return [k for c in chunk_hashes for k in head_keys(model, c, heads, pp_ranks=(pp_rank,))]


def matched_chunks(
    exists: Collection[str] | Callable[[Sequence[str]], Sequence[bool]],
    model: str,
    chunk_hashes: Sequence[int],
    heads: Iterable[int],
    *,
    pp_ranks: Iterable[int] = (0,),
) -> int:
    """How many leading chunks have every one of `heads` on every pipeline stage present.

    `exists` is a set of stored keys or a batch existence check (one round trip, as a store's
    `exists(keys)` is). A chunk with one head missing ends the prefix, whichever rank needs it.
    """
    head_list = sorted(set(heads))
    pps = tuple(pp_ranks)
    keys = [k for c in chunk_hashes for k in head_keys(model, c, head_list, pp_ranks=pps)]
    found = list(exists(keys)) if callable(exists) else [k in exists for k in keys]
    per_chunk = len(head_list) * len(pps)
    for i in range(len(chunk_hashes)):
        if not all(found[i * per_chunk : (i + 1) * per_chunk]):
            return i
    return len(chunk_hashes)


def matched_chunks_for_tp(
    exists: Collection[str] | Callable[[Sequence[str]], Sequence[bool]],
    model: str,
    chunk_hashes: Sequence[int],
    kv_heads: int,
    tp_size: int,
    *,
    pp_size: int = 1,
) -> int:
    """The prefix (in chunks) that every rank of a TP=`tp_size` consumer can load: the
    scheduler-side lookup, which checks the union of all ranks' heads, i.e. every head."""
    needed: set[int] = set()
    for rank in range(tp_size):
        needed.update(heads_for_rank(kv_heads, tp_size, rank))
    return matched_chunks(exists, model, chunk_hashes, needed, pp_ranks=range(pp_size))
