"""One pre-allocated memory area for a sidecar's memory tier, and its allocator.

The Mooncake transport registers the whole arena with the engine once, at start. An artifact
kept here is then at a fixed address in registered memory:
- a peer can read it one-sided, with no control round trip, as long as it knows the
  artifact's offset, size and checksum (the catalog the source pushes to the peers that watch
  it);
- a destination reads straight into a slot it reserved here (memory that earlier artifacts
  have already faulted in), with no copy after the read and no new registration.

Allocation is first fit over free ranges kept sorted by offset, so the lowest (warmest) memory
is reused first. Adjacent free ranges are merged. Sizes are rounded up to `ALIGN`.

A peer can still read a slot that was freed and reused (its catalog lags the source's
evictions). It then gets other bytes, and the artifact's checksum, which is verified on every
load, rejects them. Freeing a slot needs no coordination with readers.

Pure in-process logic over an anonymous mapping: pages are backed only once they are written.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap

ALIGN = 64
"""Slot sizes are rounded up to this (a cache line), so slots never share one."""


class Arena:
    """`size` bytes of anonymous memory, and a first-fit allocator of slots in it."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("arena size must be > 0")
        self.size = size - size % ALIGN
        self.mem = mmap.mmap(-1, self.size)
        self.view = memoryview(self.mem)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._ends: list[int] = [self.size]  # their ends (exclusive), same order
        self._used: dict[int, int] = {}  # slot offset -> rounded size
        self.used_bytes = 0

    @staticmethod
    def rounded(size: int) -> int:
        return max(ALIGN, (size + ALIGN - 1) & ~(ALIGN - 1))

    def alloc(self, size: int) -> int | None:
        """The offset of a free slot of at least `size` bytes, or None when no free range is
        large enough."""
        need = (size + ALIGN - 1) & ~(ALIGN - 1) or ALIGN  # `rounded`, inline: the fetch path
        starts, ends = self._starts, self._ends
        for i, start in enumerate(starts):
            if ends[i] - start >= need:
                if ends[i] - start == need:
                    del starts[i], ends[i]
                else:
                    starts[i] = start + need
                self._used[start] = need
                self.used_bytes += need
                return start
        return None

    def free(self, offset: int) -> None:
        """Give a slot back (merged with free neighbours). `KeyError` for an offset that is not
        an allocated slot."""
        size = self._used.pop(offset)
        self.used_bytes -= size
        end = offset + size
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(starts, offset)
        merge_left = i > 0 and ends[i - 1] == offset
        merge_right = i < len(starts) and starts[i] == end
        if merge_left and merge_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif merge_left:
            ends[i - 1] = end
        elif merge_right:
            starts[i] = offset
        else:
            starts.insert(i, offset)
            ends.insert(i, end)

    def slot_size(self, offset: int) -> int:
        """The rounded size of the allocated slot at `offset` (`KeyError` if none)."""
        return self._used[offset]

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, end) of every free range, in order (for tests and diagnostics)."""
        return list(zip(self._starts, self._ends, strict=True))

    def close(self) -> None:
        """Give the pages back. The mapping itself stays alive with this object (a peer's read
        racing the close reads zeros, never unmapped memory)."""
        with contextlib.suppress(ValueError, OSError):
            self.mem.madvise(mmap.MADV_DONTNEED)
