"""Copies between the device and Mooncake Store's own memory (the client's mounted segment, in
this process), with no staging: the segment is page-locked for the device once
(`HostSegments`), and a run of objects the store placed at a fixed stride moves as one strided
DMA copy (`cudaMemcpy2DAsync`, rows of an object each; `strided_runs` finds the runs).

The CUDA runtime is the one PyTorch loaded (found among the process's mappings), called through
ctypes: PyTorch has no strided host copy (its `copy_` of a strided host tensor first packs it
on the CPU). On CPU tensors (tests) the same calls copy row by row with `memmove`.

A segment is found by the mapping that holds a replica's address (`/proc/self/maps`): the store
allocates it anonymously at setup and names no base. The whole mapping is registered (the
client's own buffers may share it), once per process: its users share it, and the last one to
close unregisters it, before the client that owns the memory closes. A replica outside every
registered mapping is not copied from here: the caller reads it through the store instead.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA_MEMCPY_DEFAULT = 4
"""`cudaMemcpyDefault`: the direction read off the pointers (unified addressing)."""
CUDA_HOST_REGISTER_DEFAULT = 0


class HostCopyError(RuntimeError):
    """A CUDA runtime call failed."""


@dataclass(frozen=True, slots=True)
class Run:
    """`count` objects from position `first` on: consecutive device rows, `pitch` bytes apart
    in the store's memory."""

    first: int
    count: int
    pitch: int


def strided_runs(rows: Sequence[int], addresses: Sequence[int], width: int) -> list[Run]:
    """Objects (device row `rows[i]`, store address `addresses[i]`, `width` bytes each) cut into
    the fewest runs of consecutive rows at one stride, no two of a run overlapping: one strided
    copy each."""
    runs: list[Run] = []
    i, n = 0, len(addresses)
    while i < n:
        j = i + 1
        pitch = addresses[j] - addresses[i] if j < n else 0
        if j < n and pitch >= width and rows[j] == rows[i] + 1:
            while j < n and addresses[j] - addresses[j - 1] == pitch and rows[j] == rows[j - 1] + 1:
                j += 1
        runs.append(Run(i, j - i, pitch if j - i > 1 else width))
        i = j
    return runs


@functools.cache
def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library PyTorch loaded, or None (no CUDA, or not found)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcudart.so" in path and path not in paths:
                paths.append(path)
    # else the runtime of the CUDA wheels beside PyTorch (its primary context is the same)
    wheels = Path(torch.__file__).resolve().parent.parent / "nvidia"
    paths += sorted(str(p) for p in wheels.glob("**/libcudart.so*"))
    for name in [*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.argtypes += [ctypes.c_size_t] * 3 + [ctypes.c_int, ctypes.c_void_p]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.cudaGetLastError()  # clear it: the next call must not read it as its own
        raise HostCopyError(f"{what}: {lib.cudaGetErrorString(rc).decode()} ({rc})")


def copy_rows(
    dst: int,
    dst_pitch: int,
    src: int,
    src_pitch: int,
    width: int,
    rows: int,
    device: torch.device,
    stream: int | None = None,
) -> None:
    """`rows` rows of `width` bytes from `src` to `dst` (either side host or device memory),
    queued on `stream` (a raw CUDA stream handle; default the current stream of `device`, a
    CUDA device); on the CPU, done at once."""
    if rows <= 0:
        return
    if device.type != "cuda":
        for r in range(rows):
            ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)
        return
    lib = cuda_runtime()
    if lib is None:
        raise HostCopyError("no CUDA runtime found for strided host copies")
    if stream is None:
        stream = torch.cuda.current_stream(device).cuda_stream
    rc = lib.cudaMemcpy2DAsync(
        dst, dst_pitch, src, src_pitch, width, rows, CUDA_MEMCPY_DEFAULT, stream
    )
    _check(lib, rc, "cudaMemcpy2DAsync")


def mapping_of(address: int) -> tuple[int, int] | None:
    """(start, size) of this process's mapping that holds `address`, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if lo <= address < hi:
                return lo, hi - lo
    return None


_registry_lock = threading.Lock()
_registered: dict[int, list[int]] = {}  # mapping start -> [end, users], page-locked in-process


class HostSegments:
    """The store's memory in this process that the device copies from and into: mappings found
    by a replica's address and page-locked once per process (on a CUDA device; on the CPU
    nothing needs locking), shared by every user of the same mapping and unregistered when the
    last one closes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []  # (start, end) this user holds
        self._refused: set[int] = set()  # mapping starts that could not be registered
        self.register_s = 0.0
        """Seconds this user spent registering (page-locking a whole segment, once)."""

    def ready(self, address: int, size: int) -> bool:
        """Whether `[address, address + size)` is in registered memory, registering the mapping
        that holds it on first use; False when it cannot be (read it through the store)."""
        end = address + size
        with self._lock:
            if any(lo <= address and end <= hi for lo, hi in self._ranges):
                return True
            with _registry_lock:
                for lo, entry in _registered.items():
                    if lo <= address and end <= entry[0]:
                        entry[1] += 1
                        self._ranges.append((lo, entry[0]))
                        return True
                found = mapping_of(address)
                if found is None or found[0] in self._refused:
                    return False
                lo, n = found
                if end > lo + n or any(lo < e[0] and a < lo + n for a, e in _registered.items()):
                    self._refused.add(lo)  # it grew over, or into, a registered one
                    return False
                if not self._register(lo, n):
                    self._refused.add(lo)
                    return False
                _registered[lo] = [lo + n, 1]
                self._ranges.append((lo, lo + n))
                return True

    def _register(self, start: int, size: int) -> bool:
        if self.device.type != "cuda":
            return True
        lib = cuda_runtime()
        if lib is None:
            return False
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            rc = lib.cudaHostRegister(start, size, CUDA_HOST_REGISTER_DEFAULT)
        self.register_s += time.perf_counter() - t0
        if rc != 0:
            lib.cudaGetLastError()
            return False
        return True

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(hi - lo for lo, hi in self._ranges)

    def close(self) -> None:
        """Let go of every mapping; the last user unregisters it (before the store client
        that owns the memory closes)."""
        with self._lock:
            ranges, self._ranges = self._ranges, []
        gone: list[int] = []
        with _registry_lock:
            for lo, _ in ranges:
                entry = _registered.get(lo)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del _registered[lo]
                        gone.append(lo)
        if self.device.type == "cuda" and gone:
            lib = cuda_runtime()
            if lib is not None:
                torch.cuda.synchronize(self.device)
                for lo in gone:
                    lib.cudaHostUnregister(lo)
