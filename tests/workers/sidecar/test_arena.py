"""The memory arena's allocator: first fit from the lowest offset, merging of free neighbours,
no two slots overlapping under any order of allocations and frees, and the store's use of it
(locations, watchers, reserve/commit/release, checksums of arena bytes)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.sidecar.test_store import Clock
from workers.sidecar.arena import ALIGN, Arena
from workers.sidecar.store import (
    ArtifactCorrupted,
    ArtifactLocation,
    ArtifactStore,
    Tier,
    checksum,
)


def test_first_fit_reuses_the_lowest_free_slot_and_merges_neighbours() -> None:
    a = Arena(64 * ALIGN)
    x, y, z = a.alloc(ALIGN), a.alloc(3 * ALIGN), a.alloc(ALIGN)
    assert (x, y, z) == (0, ALIGN, 4 * ALIGN)
    assert x is not None and y is not None and z is not None
    a.free(y)
    assert a.alloc(2 * ALIGN) == ALIGN  # the hole y left, lowest first
    a.free(ALIGN)
    a.free(x)
    a.free(z)
    assert a.free_ranges() == [(0, 64 * ALIGN)] and a.used_bytes == 0


def test_sizes_round_up_to_the_alignment_and_a_full_arena_says_none() -> None:
    a = Arena(4 * ALIGN + 5)  # the odd tail is never handed out
    assert a.size == 4 * ALIGN
    assert a.alloc(1) == 0 and a.slot_size(0) == ALIGN
    assert a.alloc(3 * ALIGN) == ALIGN
    assert a.alloc(1) is None
    with pytest.raises(KeyError):
        a.free(7)  # not a slot
    with pytest.raises(ValueError):
        Arena(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 20 * ALIGN)), max_size=80))
def test_slots_never_overlap_and_the_free_list_stays_merged(
    ops: list[tuple[bool, int]],
) -> None:
    a = Arena(256 * ALIGN)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            off = a.alloc(size)
            if off is not None:
                live[off] = a.slot_size(off)
                assert live[off] >= size and off % ALIGN == 0
        else:
            victim = sorted(live)[size % len(live)]
            a.free(victim)
            del live[victim]
        spans = sorted(live.items()) + [(s, e - s) for s, e in a.free_ranges()]
        spans.sort()
        pos = 0
        for start, n in spans:  # used and free ranges tile the arena exactly
            assert start == pos
            pos += n
        assert pos == a.size
        free = a.free_ranges()
        assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(free))
        assert a.used_bytes == sum(live.values())


def _store(arena_bytes: int = 1 << 20) -> ArtifactStore:
    return ArtifactStore(memory_capacity_bytes=1 << 20, pin_memory=False, arena=Arena(arena_bytes))


def test_artifacts_live_in_the_arena_and_watchers_hear_every_change(tmp_path: Path) -> None:
    s = ArtifactStore(
        memory_capacity_bytes=10_000,
        ssd_dir=tmp_path,
        ssd_capacity_bytes=1 << 20,
        pin_memory=False,
        arena=Arena(1 << 20),
    )
    heard: list[tuple[str, ArtifactLocation | None]] = []
    unwatch = s.watch(lambda k, where: heard.append((k, where)))
    a, b = os.urandom(6000), os.urandom(6000)
    s.put("a", a)
    loc = s.location("a")
    assert loc is not None and loc.size_bytes == 6000 and loc.checksum == checksum(a)
    assert s.arena is not None and bytes(s.arena.view[loc.offset : loc.offset + 6000]) == a
    assert heard == [("a", loc)]
    s.put("b", b)  # memory full: "a" is demoted to SSD, and leaves the arena
    assert s.meta("a").tier is Tier.SSD and s.location("a") is None
    assert ("a", None) in heard and s.get("a") == a and s.get("b") == b
    s.put("b", a)  # replaced: gone, then the new location
    assert heard[-2] == ("b", None) and heard[-1][1] == s.location("b")
    s.delete("b")
    assert heard[-1] == ("b", None) and s.locations() == []
    unwatch()
    s.put("c", b"x")
    assert heard[-1] == ("b", None)


def test_an_artifact_without_a_free_slot_is_kept_outside_the_arena() -> None:
    s = _store(arena_bytes=8 * ALIGN)
    s.put("big", b"z" * (16 * ALIGN))
    assert s.location("big") is None and s.get("big") == b"z" * (16 * ALIGN)
    s.put("small", b"y" * ALIGN)
    assert s.location("small") is not None


def test_reserve_commit_and_release() -> None:
    s = _store()
    data = os.urandom(5000)
    off = s.reserve(5000)
    assert off is not None
    s.slot_view(off, 5000)[:] = data
    meta = s.commit("k", off, 5000, checksum(data))
    assert meta.size_bytes == 5000 and s.get("k") == data
    assert s.location("k") == ArtifactLocation("k", off, 5000, checksum(data))
    assert s.stats().memory_bytes == 5000
    other = s.reserve(100)
    assert other is not None and other != off
    s.release(other)
    assert s.reserve(1 << 21) is None  # larger than the memory tier
    assert ArtifactStore(memory_capacity_bytes=1 << 20).reserve(10) is None  # no arena


def test_arena_bytes_are_verified_on_every_load() -> None:
    s = _store()
    s.put("k", b"q" * 1000)
    loc = s.location("k")
    assert loc is not None and s.arena is not None
    s.arena.view[loc.offset + 10] ^= 0xFF
    with pytest.raises(ArtifactCorrupted):
        s.get("k")
    assert not s.has("k") and s.arena.used_bytes == 0
    s.put("k2", b"w" * 10)
    touched = s.location("k2", touch=True)
    assert touched is not None and s.meta("k2").reuse_count == 1


def test_a_full_arena_demotes_its_lowest_utility_artifacts_to_make_a_slot(tmp_path: Path) -> None:
    """A sidecar's memory tier is full in steady state: receiving into the arena (reserve) and
    putting into it demote the lowest-utility artifacts until a slot is free, as a put makes
    room by capacity; the demoted ones stay loadable from SSD."""
    clock = Clock()
    s = ArtifactStore(
        memory_capacity_bytes=1 << 20,
        ssd_dir=tmp_path,
        ssd_capacity_bytes=1 << 30,
        pin_memory=False,
        clock=clock,
        arena=Arena(8 * ALIGN * 64),  # eight slots of 4 KiB
    )
    blobs = {f"k{i}": os.urandom(4096) for i in range(8)}
    for k, v in blobs.items():
        s.put(k, v, recompute_s=1.0 + int(k[1:]), load_s=0.0)  # k0 is worth the least
        clock.t += 1
    assert s.arena is not None and s.arena.alloc(1) is None
    off = s.reserve(4096)
    assert off is not None and s.meta("k0").tier is Tier.SSD and s.location("k0") is None
    s.release(off)
    s.put("late", b"L" * 8000)  # two slots' worth in one piece: k0's hole is too small
    assert s.location("late") is not None and s.meta("k1").tier is Tier.SSD
    for k, v in blobs.items():
        assert s.get(k) == v
