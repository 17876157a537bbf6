"""The emulated engine's chunk store (a pool beside the KV pool): chunk KV kept by content hash,
apart from the paged prefix cache, least recently used first out, pinned while a request
copies from it.

Bookkeeping only, like the block pool: an entry is a chunk's hash and its token count; its
size is counted in tokens against the store's capacity.
"""

from __future__ import annotations

from collections import OrderedDict


class ChunkStore:
    """Chunk hash → tokens, bounded by `capacity_tokens`, LRU with pinning."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.evicted = 0
        """Chunks evicted to make room."""
        self.refused = 0
        """Chunks not stored: no room even after evicting every unpinned chunk."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._entries

    def lookup(self, chunk: int) -> int:
        """The chunk's token count (0 when not held), marking it used."""
        tokens = self._entries.get(chunk)
        if tokens is None:
            return 0
        self._entries.move_to_end(chunk)
        return tokens

    def pin(self, chunk: int) -> None:
        """Keep `chunk` from eviction until unpinned as often (a request copies from it)."""
        self._pins[chunk] = self._pins.get(chunk, 0) + 1

    def unpin(self, chunk: int) -> None:
        n = self._pins.get(chunk, 0) - 1
        if n > 0:
            self._pins[chunk] = n
        else:
            self._pins.pop(chunk, None)

    def pinned(self, chunk: int) -> bool:
        return chunk in self._pins

    def store(self, chunk: int, tokens: int) -> bool:
        """Keep the chunk's KV, evicting unpinned chunks, least recently used first, for
        room; False (nothing evicted) when even that cannot make room."""
        if chunk in self._entries:
            self._entries.move_to_end(chunk)
            return True
        short = self.used_tokens + tokens - self.capacity_tokens
        if short > 0:
            freeable = sum(t for h, t in self._entries.items() if h not in self._pins)
            if freeable < short:
                self.refused += 1
                return False
            for h in [h for h in self._entries if h not in self._pins]:
                if short <= 0:
                    break
                t = self._entries.pop(h)
                self.used_tokens -= t
                short -= t
                self.evicted += 1
        self._entries[chunk] = tokens
        self.used_tokens += tokens
        return True

    def clear(self) -> None:
        """Forget every chunk not pinned."""
        for h in [h for h in self._entries if h not in self._pins]:
            self.used_tokens -= self._entries.pop(h)

    def hashes(self) -> list[int]:
        return list(self._entries)
