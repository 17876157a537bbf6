"""Which stored artifact keys belong to which chunk: the sidecar's index from (model, chunk hash)
to the per-head keys it holds, so a peer can ask for "every artifact of these blocks" without
knowing how many heads, layers or pipeline stages the writer split a block into.

Keys are `ownerserve.kvstate.HeadArtifactKey` strings,
`{model}@pcp{p}@dcp{d}@head:{h}@pp_rank:{pp}@{chunk_hash:016x}[@{layer}][@{state}]`; keys of
another shape are stored but not indexed. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

_KEY = re.compile(
    r"^(?P<model>.+)@pcp\d+@dcp\d+@head:\d+@pp_rank:\d+@(?P<chunk>[0-9a-f]{16})(?:@[^@]+){0,2}$"
)
MAX_KEY_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ChunkId:
    """One block of one model's hash chain, as the keys of its artifacts name it."""

    model: str
    chunk_hash: int


def chunk_of(key: str) -> ChunkId | None:
    """The chunk an artifact key belongs to, or None when the key is not a head artifact key."""
    m = _KEY.match(key)
    if m is None:
        return None
    return ChunkId(m.group("model"), int(m.group("chunk"), 16))


def valid_key(key: str) -> bool:
    """Keys are path segments and file names: non-empty, bounded, no control characters."""
    return 0 < len(key) <= MAX_KEY_CHARS and not any(ord(c) < 32 or c == "\x7f" for c in key)


MAX_BLOCK_ARTIFACTS = 4096
"""Bound on a declared number of artifacts per block (KV heads x pipeline stages x parts)."""


@dataclass(slots=True)
class ChunkIndex:
    """(model, chunk hash) -> keys stored for it. The store may evict behind the index's back,
    so readers pass the store's `has` and stale keys are forgotten as they are met.

    A block is *whole* once as many of its keys are present as its writer declared it has
    (`add(key, whole=N)`: the connector knows the model's KV heads; a fetch knows the source's
    list). Readers see only whole blocks, so a block being written head by head is neither
    published nor served before its last head. A block nobody declared is whole with one key
    (writers that do not declare, and blocks recovered from the SSD tier after a restart)."""

    _keys: dict[ChunkId, set[str]] = field(default_factory=dict)
    _whole: dict[ChunkId, int] = field(default_factory=dict)

    def add(self, key: str, whole: int | None = None) -> ChunkId | None:
        """Index `key`; `whole`: how many keys make its block whole (the largest declared
        counts)."""
        chunk = chunk_of(key)
        if chunk is not None:
            self._keys.setdefault(chunk, set()).add(key)
            if whole is not None and whole > self._whole.get(chunk, 1):
                self._whole[chunk] = whole
        return chunk

    def discard(self, key: str) -> None:
        chunk = chunk_of(key)
        if chunk is None:
            return
        keys = self._keys.get(chunk)
        if keys is not None:
            keys.discard(key)
            if not keys:
                self._forget(chunk)

    def _forget(self, chunk: ChunkId) -> None:
        del self._keys[chunk]
        self._whole.pop(chunk, None)

    def keys_of(self, chunk: ChunkId, present: Callable[[str], bool]) -> list[str]:
        """The keys of a whole chunk still `present`, sorted; [] while the chunk is not whole
        (stale keys are dropped from the index)."""
        keys = self._keys.get(chunk)
        if not keys:
            return []
        stale = [k for k in keys if not present(k)]
        for k in stale:
            keys.discard(k)
        if not keys:
            self._forget(chunk)
            return []
        if len(keys) < self._whole.get(chunk, 1):
            return []
        return sorted(keys)

    def chunks(self) -> list[ChunkId]:
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def stored_prefix(keys_per_block: Sequence[Sequence[str]]) -> int:
    """How many leading blocks have at least one artifact (a fetch stops at the first gap)."""
    for i, keys in enumerate(keys_per_block):
        if not keys:
            return i
    return len(keys_per_block)


def whole_blocks(keys_per_block: Sequence[Iterable[str]], present: Callable[[str], bool]) -> int:
    """How many leading blocks have every one of their keys `present`."""
    for i, keys in enumerate(keys_per_block):
        if not all(present(k) for k in keys):
            return i
    return len(keys_per_block)
