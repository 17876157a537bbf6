"""Chained block hashes of token ids: the identity of a KV prefix block.

Block i's hash is H(parent_i, tokens of block i) where parent_0 is a root derived from the model
name and a salt, so equal hashes mean equal prefixes of the same model. The router, the emulated
engine and the directory (which rebuilds hashes from the token ids in vLLM's KV events) all use
this one scheme. Hashes are unsigned 64-bit integers (blake2b, 8-byte digest).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

_MASK64 = (1 << 64) - 1


def chain_root(model: str, salt: str = "") -> int:
    """The parent hash of a chain's first block for `model` and `salt`."""
    digest = blake2b(f"ownerserve:{model}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK64


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
