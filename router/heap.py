"""Hands the free pages glibc malloc keeps back to the OS (`malloc_trim`), for the router's heap
trim loop (`server.heap_trim_interval_s`). The router's large tables (the directory mirror's
dicts, rebuilt at 2.6-10 MB each as blocks come and go) are freed into malloc's heap, which
keeps their pages: RSS then climbs while the heap in use stays flat. A no-op off glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Release malloc's free memory to the OS (whole free pages anywhere in its heaps, not just
    at the top); whether any was released. Takes malloc's lock for the walk (about a
    millisecond for a heap of ~100 MB)."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1
