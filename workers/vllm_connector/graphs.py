"""Fixed sequences of kernel launches over static buffers, replayed as one CUDA graph: what the
store path's grouped saves and loads queue on the device (the ids' upload, gather, digests; the
uploads, checks, gated scatter) costs one replay of host time (~0.014 ms measured on an H200)
instead of each Triton launch's ~0.15-0.4 ms, so the host reaches the master's answers and the
copies sooner and the store's RPC threads are not held off the GIL
(bench/history/mooncake_store.md, 2026-12-03).

`Captured(fn)`: `run()` calls `fn` as it is the first time on a CUDA stream (compiling its
kernels, its work done), captures it into a graph, and from then on replays the graph on the
current stream; on CPU tensors (tests) it always calls `fn`. `fn` must only launch work over
buffers that outlive it (the graph replays the same addresses) and be idempotent.

`Slots`: a few such sequences with their buffers per shape, taken and given back, so the
buffers of a save still being copied are not overwritten by the next one's replay.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class Captured:
    """`fn`'s launches, replayed as one CUDA graph after its first run (see the module
    docstring)."""

    __slots__ = ("_capture", "_device", "_fn", "_graph")

    def __init__(
        self, fn: Callable[[], object], device: torch.device, *, capture: bool = True
    ) -> None:
        self._fn = fn
        self._device = device
        self._capture = capture and device.type == "cuda"
        """False: `run` always calls `fn` (launch by launch, for comparison)."""
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def run(self) -> None:
        """Queue the launches on the current stream (CPU tensors: run them)."""
        if not self._capture:
            self._fn()
            return
        if self._graph is None:
            stream = torch.cuda.current_stream(self._device)
            self._fn()  # compiled and run once, eagerly: this call's work is done
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._fn()
            self._graph = graph
            return
        self._graph.replay()


class Slots(Generic[T]):
    """Up to `per_key` objects per key (`make(key)` builds one), each taken by one user at a time;
    at most `keys` keys kept (the least recently used dropped, with its objects, once none of
    them is taken)."""

    def __init__(self, make: Callable[[Hashable], T], *, per_key: int = 2, keys: int = 4) -> None:
        self._make = make
        self._per_key = per_key
        self._keys = keys
        self._lock = threading.Lock()
        self._free: OrderedDict[Hashable, list[T]] = OrderedDict()
        self._count: dict[Hashable, int] = {}

    def take(self, key: Hashable) -> T | None:
        """A free object of `key` (built if fewer than `per_key` exist), or None when all are
        taken (the caller goes without)."""
        with self._lock:
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if free:
                return free.pop()
            if self._count.get(key, 0) >= self._per_key:
                return None
            self._count[key] = self._count.get(key, 0) + 1
            while len(self._free) > self._keys:
                old = next(iter(self._free))
                if old == key or len(self._free[old]) < self._count.get(old, 0):
                    break  # the oldest is in use: keep it for now
                del self._free[old]
                del self._count[old]
        try:
            return self._make(key)
        except BaseException:
            with self._lock:
                self._count[key] -= 1
            raise

    def give(self, key: Hashable, item: T) -> None:
        with self._lock:
            if key in self._count:
                self._free.setdefault(key, []).append(item)
