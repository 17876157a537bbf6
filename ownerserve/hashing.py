"""Chained block hashes of token ids: the identity of a KV prefix block.

Block i's hash is H(parent_i, tokens of block i) where parent_0 is a root derived from the model
name and a salt, so equal hashes mean equal prefixes of the same model. The router, the emulated
engine and the directory (which rebuilds hashes from the token ids in vLLM's KV events) all use
this one scheme. Hashes are unsigned 64-bit integers: XXH3-64 of the block's token ids as
little-endian uint32, seeded with the parent's hash (~5x faster than the 8-byte blake2b digest
it replaced, with the same 64 bits). `router/tokens.py` and `workers/emulator/kv_cache.py` hold
packed-buffer copies of `block_hash_chain` for their hot paths; tests pin them equal.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash


def chain_root(model: str, salt: str = "") -> int:
    """The parent hash of a chain's first block for `model` and `salt`."""
    return xxhash.xxh3_64_intdigest(f"ownerserve:{model}:{salt}".encode())


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    data = array("I", tokens)
    if sys.byteorder != "little":
        data.byteswap()
    return xxhash.xxh3_64_intdigest(data.tobytes(), parent)


def block_hash_chain(
    tokens: Sequence[int], block_size: int, root: int, *, start_parent: int | None = None
) -> list[int]:
    """Hashes of every *full* block of `tokens`; a trailing partial block has no hash.

    `start_parent` continues a chain from an earlier block (defaults to `root`).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    parent = root if start_parent is None else start_parent
    out: list[int] = []
    full = len(tokens) - len(tokens) % block_size
    for i in range(0, full, block_size):
        parent = hash_block(parent, tokens[i : i + block_size])
        out.append(parent)
    return out


class ChainHasher:
    """Hashes a growing token sequence incrementally, reusing the hashes of blocks seen before.

    Each call to `extend` hashes only tokens beyond the longest already-hashed prefix that is
    still identical, so a multi-turn session re-hashes only its new blocks.
    """

    __slots__ = ("_hashes", "_tokens", "block_size", "root")

    def __init__(self, block_size: int, root: int) -> None:
        self.block_size = block_size
        self.root = root
        self._tokens: list[int] = []
        self._hashes: list[int] = []

    @property
    def hashes(self) -> list[int]:
        return self._hashes

    def update(self, tokens: Sequence[int]) -> list[int]:
        """Set the sequence to `tokens` and return its full-block hash chain."""
        bs = self.block_size
        keep = 0
        limit = min(len(self._hashes), len(tokens) // bs)
        while keep < limit:
            lo, hi = keep * bs, (keep + 1) * bs
            if self._tokens[lo:hi] != list(tokens[lo:hi]):
                break
            keep += 1
        parent = self._hashes[keep - 1] if keep else self.root
        new = block_hash_chain(tokens[keep * bs :], bs, self.root, start_parent=parent)
        self._hashes = self._hashes[:keep] + new
        self._tokens = list(tokens)
        return self._hashes
