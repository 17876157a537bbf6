"""Malloc's free pages handed back to the OS (`router/heap.py`), measured on this process's RSS,
and the router's loop that does it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ownerserve.config import settings_from_dict
from router.heap import trim_heap
from router.state import Router
from tests.waiting import until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc, /proc")

_MIB = 2**20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _free_below_a_kept_block(mib: int) -> bytes:
    """`mib` MiB of 64 KiB blocks from malloc's heap (below its mmap threshold), all freed
    but the last, which keeps the heap's top in use: free() alone returns none of it."""
    blocks = [bytes(64 * 1024 - 64) for _ in range(mib * 16)]
    for b in blocks:
        assert b[0] == 0  # touched: resident
    kept = blocks.pop()
    del blocks
    return kept


def test_trimming_returns_the_free_pages_under_the_heaps_top_to_the_os() -> None:
    kept = _free_below_a_kept_block(64)
    before = _rss()
    assert trim_heap()
    assert _rss() < before - 32 * _MIB
    assert len(kept) > 0


async def test_the_router_trims_its_heap_every_interval() -> None:
    settings = settings_from_dict(
        {"server": {"heap_trim_interval_s": 0.05}, "models": [{"name": "m"}], "workers": []}
    )
    router = Router(settings)
    await router.start()
    try:
        kept = _free_below_a_kept_block(16)
        await until(lambda: router.heap_trims > 0, what="a trim that released memory")
        assert len(kept) > 0
    finally:
        await router.close()
