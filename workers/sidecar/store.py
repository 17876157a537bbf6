"""KV artifact store of one worker: a CPU memory tier (pinned when CUDA exists) over a local SSD
file tier, artifacts keyed by per-head artifact keys (`ownerserve.kvstate.HeadArtifactKey`
strings; MLA is head 0), payloads in the block-first staging layout of `kernels.layouts`.

Every artifact carries a checksum taken when it is stored and verified on every load, from
either tier: a corrupted or truncated artifact raises `ArtifactCorrupted` and is dropped, never
returned. The checksum is XXH3-128, a 128-bit non-cryptographic hash (~10-45 GB/s on one core
here, SHA-256 ~1.5 GB/s, so verifying never bounds a transfer): it guards against corruption,
truncation and stale reads inside a trusted cluster, not against a malicious peer.
Capacity is per tier in bytes; when the memory tier is full the lowest-utility artifacts
are demoted to SSD, and when SSD is full the lowest-utility ones are dropped (utility:
`artifact_utility`, expected seconds saved per byte kept).

With `write_behind` (what the sidecar uses) the SSD tier's file writes and deletions are done by
one thread of the store, in the order they were asked for, while the caller goes on: demoting
a 256 MiB artifact no longer holds the sidecar's event loop for the ~0.8 s its write takes.
That thread syncs each file to disk (`fdatasync`) before renaming it into place, so after a
crash the tier holds whole files (and `.tmp` leftovers, deleted by `recover_ssd`), and the
page cache does not fill with dirty KV. Bytes on their way to a file stay readable from memory
until the file is whole; at most `max_pending_bytes` wait at a time (beyond that the caller
waits for the oldest writes), and `flush()` waits for all. A write that fails (disk full, I/O
error) is logged and counted (`StoreStats.ssd_write_errors`); its artifact then fails its
checksum on the next load and is dropped, as a file corrupted on disk is. `ssd_reader` hands
the reading of an SSD file to another thread in the same way.

With an `arena` (`workers.sidecar.arena`, what the Mooncake transport uses) the memory tier keeps
artifacts in one pre-allocated area at fixed offsets: `location(key)` says where, watchers
(`watch`) hear of every artifact that appears there or leaves, and a destination can read a
peer's artifact straight into a slot (`reserve`, then `commit` or `release`). Artifacts that
find no free slot are kept as ordinary memory (and have no location).

Pure in-process logic plus file I/O on its own directory; no network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import xxhash

from ownerserve.records import fast_init
from workers.sidecar.arena import Arena

CHECKSUM_NAME = "XXH3-128"
CHECKSUM_BYTES = 16
_MAGIC = b"OSKV2\n"
_KEY_LEN = struct.Struct("<H")
_TAIL = struct.Struct(f"<{CHECKSUM_BYTES}sdd")  # checksum, recompute_s, load_s
_MAX_HEADER = len(_MAGIC) + _KEY_LEN.size + 4 * 1024 + _TAIL.size
MAX_PENDING_BYTES = 1 << 30
"""Default bytes of write-behind SSD writes that may wait at a time (held in memory)."""

log = logging.getLogger(__name__)


class StoreError(Exception):
    """Base of the artifact store's errors."""


class ArtifactMissing(StoreError, KeyError):
    """No artifact is stored under the key."""


class ArtifactCorrupted(StoreError):
    """An artifact's bytes do not match its checksum (it was dropped)."""


class ArtifactTooLarge(StoreError, ValueError):
    """An artifact is larger than every tier's capacity."""


class Tier(StrEnum):
    MEMORY = "memory"
    SSD = "ssd"


def checksum(data: bytes | bytearray | memoryview) -> bytes:
    """The artifact checksum: the XXH3-128 digest of the payload (`CHECKSUM_BYTES` bytes)."""
    return xxhash.xxh3_128_digest(data)


def new_hasher() -> xxhash.xxh3_128:
    """An incremental `checksum`: `update(part)` for each part in order, then `digest()`."""
    return xxhash.xxh3_128()


@fast_init
@dataclass(frozen=True, slots=True)
class ArtifactMeta:
    """What the store knows of one artifact besides its bytes."""

    key: str
    size_bytes: int
    checksum: bytes
    recompute_s: float
    load_s: float
    reuse_count: int = 0
    last_access_s: float = 0.0
    tier: Tier = Tier.MEMORY


def artifact_utility(meta: ArtifactMeta, now_s: float, *, half_life_s: float = 600.0) -> float:
    """Expected seconds saved per byte kept, the eviction rank (lowest goes first):

        (1 + reuse_count) · 2^(−age / half_life) · max(recompute_s − load_s, 0) / size_bytes

    Reuse count and recency estimate the chance of another hit; recompute minus load is what a
    hit saves; dividing by size ranks artifacts by value per byte of the tier they occupy."""
    if meta.size_bytes <= 0:
        return float("inf")
    age = max(0.0, now_s - meta.last_access_s)
    p_reuse = (1 + max(0, meta.reuse_count)) * 2.0 ** (-age / half_life_s)
    return p_reuse * max(meta.recompute_s - meta.load_s, 0.0) / meta.size_bytes


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of a store."""

    memory_bytes: int
    ssd_bytes: int
    artifacts: int
    hits: int
    misses: int
    corrupted: int
    demoted: int
    dropped: int
    ssd_pending_bytes: int = 0
    """Bytes of write-behind SSD writes not yet in their files."""
    ssd_write_errors: int = 0
    """Write-behind SSD writes that failed (their artifacts fail their next load)."""


_CUDA: list[bool] = []
_PIN_FAILED: list[bool] = []


def _cuda_available() -> bool:
    """Whether torch sees a GPU, asked once per process (it is on every put's path)."""
    if not _CUDA:
        try:
            import torch

            _CUDA.append(bool(torch.cuda.is_available()))
        except Exception:  # pragma: no cover - torch missing or broken
            log.warning("torch unusable: CPU-tier artifacts are kept unpinned", exc_info=True)
            _CUDA.append(False)
    return _CUDA[0]


def _pinned_buffer(data: bytes) -> object:
    """Page-locked copy of `data` when CUDA exists (fast H2D), else the bytes themselves."""
    if not _cuda_available():
        return data
    try:
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory()
    except Exception:  # pragma: no cover - pinning failure
        if not _PIN_FAILED:
            _PIN_FAILED.append(True)  # once: it fails the same way for every artifact
            log.warning("pinning host memory failed: artifacts are kept unpinned", exc_info=True)
        return data


def _as_bytes(buf: object) -> bytes:
    if isinstance(buf, bytes):
        return buf
    import torch

    assert isinstance(buf, torch.Tensor)
    return bytes(buf.numpy().tobytes())


@dataclass(frozen=True, slots=True)
class ArtifactLocation:
    """Where an arena-resident artifact lies: its slot's offset in the arena, its size and
    checksum (what a peer needs to read and verify it one-sided)."""

    key: str
    offset: int
    size_bytes: int
    checksum: bytes


@fast_init
@dataclass(frozen=True, slots=True)
class _Slot:
    """The memory tier's handle of an artifact kept in the arena (made on every commit)."""

    offset: int
    size: int


Watcher = Callable[[str, ArtifactLocation | None], None]
"""Called with (key, its new location) when an artifact enters the arena, (key, None) when it
leaves it (deleted, replaced, demoted or dropped)."""

_SAFE = re.compile(r"[^A-Za-z0-9._@:-]")


def _ssd_header(meta: ArtifactMeta) -> bytes:
    """An SSD file's header: magic, u16 key length, key (UTF-8), checksum, recompute_s, load_s;
    the payload follows (its size is the file's size less the header)."""
    key = meta.key.encode()
    return (
        _MAGIC
        + _KEY_LEN.pack(len(key))
        + key
        + _TAIL.pack(meta.checksum, meta.recompute_s, meta.load_s)
    )


def _parse_ssd_header(raw: bytes) -> tuple[str, bytes, float, float, int] | None:
    """(key, checksum, recompute_s, load_s, header length) of an SSD file, or None when `raw`
    does not start with a whole, well-formed header."""
    at = len(_MAGIC)
    if not raw.startswith(_MAGIC) or len(raw) < at + _KEY_LEN.size:
        return None
    (n,) = _KEY_LEN.unpack_from(raw, at)
    at += _KEY_LEN.size
    end = at + n + _TAIL.size
    if len(raw) < end:
        return None
    try:
        key = raw[at : at + n].decode()
    except UnicodeDecodeError:
        return None
    digest, recompute_s, load_s = _TAIL.unpack_from(raw, at + n)
    return key, digest, recompute_s, load_s, end


def _write_file(path: Path, header: bytes, data: bytes, durable: bool = False) -> None:
    """Write an SSD file whole: a temporary file, then renamed over the final name;
    `durable`: its bytes reach the disk before the rename."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(data)
        if durable:
            f.flush()
            os.fdatasync(f.fileno())
    os.replace(tmp, path)


def _read_file(path: Path, key: str) -> bytes:
    """The payload of `key`'s SSD file; b"" (which fails any checksum) when the file is gone,
    unreadable or not that key's."""
    try:
        raw = path.read_bytes()
    except OSError:
        return b""
    head = _parse_ssd_header(raw[:_MAX_HEADER])
    if head is None or head[0] != key:
        return b""
    return raw[head[4] :]


def _unlink(path: Path) -> None:
    """Delete an SSD file; one that cannot be deleted is logged (the store has forgotten its
    artifact either way)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot delete SSD file %s: %s", path, exc)


@dataclass(slots=True)
class ArtifactStore:
    """Two-tier KV artifact store. Not thread-safe: one owner (the sidecar's event loop)."""

    memory_capacity_bytes: int
    ssd_dir: Path | None = None
    ssd_capacity_bytes: int = 0
    half_life_s: float = 600.0
    pin_memory: bool = True
    clock: Callable[[], float] = time.monotonic
    arena: Arena | None = None
    write_behind: bool = False
    max_pending_bytes: int = MAX_PENDING_BYTES
    _watchers: list[Watcher] = field(default_factory=list, init=False)
    # write-behind: the writer thread, its jobs in order, and the bytes not yet in their files
    _writer: ThreadPoolExecutor | None = field(default=None, init=False)
    _jobs: deque[Future[object]] = field(default_factory=deque, init=False)
    _io_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _pending: dict[str, tuple[int, bytes]] = field(default_factory=dict, init=False)
    _pending_bytes: int = field(default=0, init=False)
    _writes: int = field(default=0, init=False)  # numbers each write (the same bytes may recur)
    _write_errors: int = field(default=0, init=False)
    _meta: dict[str, ArtifactMeta] = field(default_factory=dict)
    _mem: dict[str, object] = field(default_factory=dict)
    _mem_bytes: int = 0
    _ssd_bytes: int = 0
    _hits: int = 0
    _misses: int = 0
    _corrupted: int = 0
    _demoted: int = 0
    _dropped: int = 0

    def __post_init__(self) -> None:
        if self.memory_capacity_bytes < 0 or self.ssd_capacity_bytes < 0:
            raise ValueError("capacities must be >= 0")
        if self.ssd_dir is not None:
            self.ssd_dir = Path(self.ssd_dir)
            self.ssd_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.ssd_capacity_bytes = 0

    # --- queries ---------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self._meta

    def has_many(self, keys: Iterable[str]) -> list[bool]:
        return [k in self._meta for k in keys]

    def meta(self, key: str) -> ArtifactMeta:
        try:
            return self._meta[key]
        except KeyError:
            raise ArtifactMissing(key) from None

    def keys(self) -> list[str]:
        return list(self._meta)

    def location(self, key: str, *, touch: bool = False) -> ArtifactLocation | None:
        """Where the artifact lies in the arena, or None when it is not there (absent, on
        SSD, or kept outside the arena). `touch=True` counts a reuse, as serving it does."""
        slot = self._mem.get(key)
        if not isinstance(slot, _Slot):
            return None
        meta = self._meta[key]
        if touch:
            self._hits += 1
            self._meta[key] = replace(
                meta, reuse_count=meta.reuse_count + 1, last_access_s=self.clock()
            )
        return ArtifactLocation(key, slot.offset, slot.size, meta.checksum)

    def locations(self) -> list[ArtifactLocation]:
        """Every arena-resident artifact's location."""
        return [
            ArtifactLocation(k, v.offset, v.size, self._meta[k].checksum)
            for k, v in self._mem.items()
            if isinstance(v, _Slot)
        ]

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher` on every change of an arena location; returns the unsubscribe."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def _announce(self, key: str, where: ArtifactLocation | None) -> None:
        for watcher in list(self._watchers):
            watcher(key, where)

    def stats(self) -> StoreStats:
        return StoreStats(
            self._mem_bytes,
            self._ssd_bytes,
            len(self._meta),
            self._hits,
            self._misses,
            self._corrupted,
            self._demoted,
            self._dropped,
            self._pending_bytes,
            self._write_errors,
        )

    # --- put / get / delete ----------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes,
        *,
        expected_checksum: bytes | None = None,
        already_verified: bool = False,
        recompute_s: float | None = None,
        load_s: float | None = None,
    ) -> ArtifactMeta:
        """Store `data` under `key` (replacing any old value). With `expected_checksum` (bytes
        received from a peer) the payload is verified first and `ArtifactCorrupted` raised on a
        mismatch, storing nothing. `already_verified=True` says the caller has just hashed
        `data` itself (incrementally, while receiving) and it equals `expected_checksum`."""
        data = bytes(data)
        if already_verified:
            if expected_checksum is None:
                raise ValueError("already_verified needs expected_checksum")
            digest = expected_checksum
        else:
            digest = checksum(data)
        if expected_checksum is not None and digest != expected_checksum:
            self._corrupted += 1
            raise ArtifactCorrupted(f"checksum mismatch for {key}")
        size = len(data)
        if size > max(self.memory_capacity_bytes, self.ssd_capacity_bytes):
            raise ArtifactTooLarge(f"{key}: {size} bytes exceed every tier")
        meta = self._replacing(key, size, digest, recompute_s, load_s)
        if size <= self.memory_capacity_bytes:
            self._make_room(Tier.MEMORY, size, protect=key)
            offset = None
            if self.arena is not None and size:
                offset = self.arena.alloc(size)
                if offset is None:
                    offset = self._demote_for_slot(size, protect=key)
            if offset is not None:
                assert self.arena is not None
                self.arena.view[offset : offset + size] = data
                self._keep_slot(meta, offset)
                return meta
            self._mem[key] = _pinned_buffer(data) if self.pin_memory else data
            self._mem_bytes += size
            self._meta[key] = meta
        else:
            self._make_room(Tier.SSD, size, protect=key)
            self._write_ssd(meta, data)
            self._meta[key] = replace(meta, tier=Tier.SSD)
        return self._meta[key]

    def reserve(self, size: int) -> int | None:
        """An arena slot of `size` bytes to receive an artifact into (then `commit` or
        `release` it), or None without an arena or when no slot can be freed. Like a put, it
        makes room first (demoting the lowest-utility artifacts); the slot counts against the
        memory tier's capacity once committed."""
        if self.arena is None or size <= 0 or size > self.memory_capacity_bytes:
            return None
        # checked here, not only in `_make_room`: on a fetch's hot path the call alone costs
        # ~0.3 us (reserve and commit both do this: 0.6 us of a 4.7 us small fetch, VM)
        if self._mem_bytes + size > self.memory_capacity_bytes:
            self._make_room(Tier.MEMORY, size, protect="")
        offset = self.arena.alloc(size)
        return offset if offset is not None else self._demote_for_slot(size, protect="")

    def _demote_for_slot(self, size: int, protect: str) -> int | None:
        """An arena slot when `Arena.alloc` found none free (reserved slots, or free space in
        pieces): the lowest-utility arena artifacts are demoted one by one until one is."""
        assert self.arena is not None
        now = self.clock()
        ranked = sorted(
            (self._meta[k] for k, v in self._mem.items() if isinstance(v, _Slot) and k != protect),
            key=lambda m: artifact_utility(m, now, half_life_s=self.half_life_s),
        )
        for meta in ranked:
            self._demote(meta.key)
            offset = self.arena.alloc(size)
            if offset is not None:
                return offset
        return None

    def release(self, offset: int) -> None:
        """Give back a reserved slot that was not committed."""
        assert self.arena is not None
        self.arena.free(offset)

    def slot_view(self, offset: int, size: int) -> memoryview:
        """The arena bytes of a reserved slot (to hash what was read into it)."""
        assert self.arena is not None
        return self.arena.view[offset : offset + size]

    def commit(
        self,
        key: str,
        offset: int,
        size: int,
        digest: bytes,
        *,
        recompute_s: float | None = None,
        load_s: float | None = None,
    ) -> ArtifactMeta:
        """Store the artifact of `size` bytes that was read into the reserved slot at `offset`
        and verified by the caller against `digest` (replacing any old value)."""
        assert self.arena is not None and self.arena.slot_size(offset) >= size
        meta = self._replacing(key, size, digest, recompute_s, load_s)
        if self._mem_bytes + size > self.memory_capacity_bytes:
            self._make_room(Tier.MEMORY, size, protect=key)
        self._keep_slot(meta, offset)
        return meta

    def uncommit(self, key: str) -> int:
        """Undo the `commit` of `key` (an arena artifact): it is gone, as after `delete`, but
        its slot stays reserved, as `reserve` returned it, until `release` (a read may still
        be writing into it). Returns the slot's offset."""
        if not isinstance(self._mem.get(key), _Slot):
            raise ArtifactMissing(key)
        meta = self._meta.pop(key)
        slot = self._forget_memory(key, free_slot=False)
        self._mem_bytes -= meta.size_bytes
        assert isinstance(slot, _Slot)
        return slot.offset

    def _replacing(
        self, key: str, size: int, digest: bytes, recompute_s: float | None, load_s: float | None
    ) -> ArtifactMeta:
        """The metadata of a new value of `key`; any old value is deleted."""
        if key in self._meta:
            self.delete(key)
        # defaults: recompute ~ 1 GB/s of KV, reload ~ 10 GB/s (only the ratio ranks artifacts)
        return ArtifactMeta(
            key,
            size,
            digest,
            recompute_s if recompute_s is not None else size / 1e9,
            load_s if load_s is not None else size / 1e10,
            0,
            self.clock(),
        )

    def _keep_slot(self, meta: ArtifactMeta, offset: int) -> None:
        self._mem[meta.key] = _Slot(offset, meta.size_bytes)
        self._mem_bytes += meta.size_bytes
        self._meta[meta.key] = meta
        if self._watchers:
            self._announce(
                meta.key, ArtifactLocation(meta.key, offset, meta.size_bytes, meta.checksum)
            )

    def _memory_bytes_of(self, key: str) -> bytes:
        buf = self._mem[key]
        if isinstance(buf, _Slot):
            assert self.arena is not None
            return bytes(self.arena.view[buf.offset : buf.offset + buf.size])
        return _as_bytes(buf)

    def _forget_memory(self, key: str, free_slot: bool = True) -> object:
        """Take an artifact out of the memory tier; its slot, if any, is freed unless
        `free_slot` is false (announced either way)."""
        buf = self._mem.pop(key)
        if isinstance(buf, _Slot):
            assert self.arena is not None
            if free_slot:
                self.arena.free(buf.offset)
            if self._watchers:
                self._announce(key, None)
        return buf

    def get(self, key: str) -> bytes:
        """The artifact's bytes, checksum-verified; counts a reuse. Raises `ArtifactMissing`, or
        `ArtifactCorrupted` (and drops the artifact) when the bytes do not match."""
        return self.get_verified(key)[0]

    def get_verified(
        self, key: str, *, loaded: tuple[bytes, bytes | None] | None = None
    ) -> tuple[bytes, bytes]:
        """`get` plus the checksum the bytes were just verified against (to send to a peer).
        `loaded`: what an `ssd_reader(key)` returned (bytes, and their checksum when it took
        it), used when they are still the artifact's."""
        meta = self._meta.get(key)
        if meta is None:
            self._misses += 1
            raise ArtifactMissing(key)
        data: bytes | None = None
        if loaded is not None and meta.tier is Tier.SSD:
            data, digest = loaded
            if (digest or checksum(data)) != meta.checksum:
                data = None  # changed while it was read elsewhere: read it here
        if data is None:
            data = self._load(key, meta)
            if checksum(data) != meta.checksum:
                self._corrupted += 1
                self.delete(key)
                raise ArtifactCorrupted(f"checksum mismatch for {key} ({meta.tier})")
        self._hits += 1
        self._meta[key] = replace(
            meta, reuse_count=meta.reuse_count + 1, last_access_s=self.clock()
        )
        return data, meta.checksum

    def read_for_transfer(
        self, key: str, *, loaded: tuple[bytes, bytes | None] | None = None
    ) -> tuple[bytes, bytes]:
        """The artifact's bytes and the checksum taken when it was stored, NOT verified here
        (so a corrupted one is not dropped either): the transfer servers serve peers with
        `get_verified` instead (`workers.sidecar.transport.read_for_transfer`). Counts a reuse.
        `loaded` as for `get_verified` (used when its size is still the artifact's)."""
        meta = self._meta.get(key)
        if meta is None:
            self._misses += 1
            raise ArtifactMissing(key)
        if loaded is not None and meta.tier is Tier.SSD and len(loaded[0]) == meta.size_bytes:
            data = loaded[0]
        else:
            data = self._load(key, meta)
        self._hits += 1
        self._meta[key] = replace(
            meta, reuse_count=meta.reuse_count + 1, last_access_s=self.clock()
        )
        return data, meta.checksum

    def _load(self, key: str, meta: ArtifactMeta) -> bytes:
        return self._memory_bytes_of(key) if meta.tier is Tier.MEMORY else self._read_ssd(key)

    def delete(self, key: str) -> bool:
        meta = self._meta.pop(key, None)
        if meta is None:
            return False
        if meta.tier is Tier.MEMORY:
            self._forget_memory(key)
            self._mem_bytes -= meta.size_bytes
        else:
            self._ssd_bytes -= meta.size_bytes
            if self.write_behind:  # after any write of it still waiting
                self._submit(_unlink, self._path(key))
            else:
                _unlink(self._path(key))
        return True

    # --- tiers -----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        assert self.ssd_dir is not None
        name = _SAFE.sub("_", key)
        return self.ssd_dir / f"{name}.{checksum(key.encode()).hex()[:12]}.kv"

    def _write_ssd(self, meta: ArtifactMeta, data: bytes) -> None:
        path, header = self._path(meta.key), _ssd_header(meta)
        self._ssd_bytes += len(data)
        if not self.write_behind:
            _write_file(path, header, data)
            return
        self._writes += 1
        with self._io_lock:
            self._pending[meta.key] = (self._writes, data)
            self._pending_bytes += len(data)
        self._submit(self._write_behind, meta.key, self._writes, path, header, data)
        while self._pending_bytes > self.max_pending_bytes and self._jobs:
            self._jobs.popleft().result()  # too much waiting in memory: wait for the oldest

    def _write_behind(self, key: str, n: int, path: Path, header: bytes, data: bytes) -> None:
        """The writer thread's job (write number `n`): the file, then the bytes are no longer
        held (a newer write of the key, queued meanwhile, stays pending)."""
        try:
            _write_file(path, header, data, durable=True)
        except OSError as exc:
            self._write_errors += 1  # only this thread counts them
            log.warning("SSD write of %s (%d bytes) failed: %s", key, len(data), exc)
            _unlink(path.with_suffix(".tmp"))
        finally:
            with self._io_lock:
                if self._pending.get(key, (0,))[0] == n:
                    del self._pending[key]
                self._pending_bytes -= len(data)

    def _submit(self, fn: Callable[..., object], *args: object) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="store-ssd")
        while self._jobs and self._jobs[0].done():
            self._jobs.popleft()
        self._jobs.append(self._writer.submit(fn, *args))

    def flush(self) -> None:
        """Wait until every write-behind SSD write and deletion asked for so far is done."""
        while self._jobs:
            self._jobs.popleft().result()

    def close(self) -> None:
        """`flush`, then stop the writer thread (a later write starts a new one)."""
        self.flush()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

    def _read_ssd(self, key: str) -> bytes:
        if self.write_behind:
            with self._io_lock:
                pending = self._pending.get(key)
            if pending is not None:
                return pending[1]
        return _read_file(self._path(key), key)

    def ssd_reader(
        self, key: str, *, verify: bool
    ) -> Callable[[], tuple[bytes, bytes | None]] | None:
        """For an artifact whose bytes must come from its SSD file: a function that reads
        them (and, with `verify`, takes their checksum), to run in another thread: it touches
        only the file, while this store is not thread-safe. What it returns goes to
        `get_verified(key, loaded=...)` or `read_for_transfer(key, loaded=...)` back on the
        store's thread. None when no file must be read (the artifact is missing, in memory,
        or still being written): call those directly."""
        meta = self._meta.get(key)
        if meta is None or meta.tier is not Tier.SSD:
            return None
        if self.write_behind:
            with self._io_lock:
                if key in self._pending:
                    return None
        path = self._path(key)

        def read() -> tuple[bytes, bytes | None]:
            data = _read_file(path, key)
            return data, checksum(data) if verify else None

        return read

    def recover_ssd(self) -> list[str]:
        """Index the SSD tier's files an earlier run left (the sidecar's restart): headers only,
        payloads are verified on every load as always. Unreadable, foreign or duplicate files
        and unfinished `.tmp` writes are deleted, and so are the oldest files beyond the SSD
        capacity. Returns the keys recovered, newest first."""
        if self.ssd_dir is None:
            return []
        found: list[tuple[float, ArtifactMeta, Path]] = []
        for path in self.ssd_dir.iterdir():
            if path.suffix not in (".kv", ".tmp") or not path.is_file():
                continue
            try:
                with open(path, "rb") as f:
                    head = _parse_ssd_header(f.read(_MAX_HEADER))
                st = path.stat()
            except OSError:
                continue
            if (
                path.suffix == ".tmp"
                or head is None
                or path != self._path(head[0])
                or head[0] in self._meta
            ):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            key, digest, recompute_s, load_s, header_bytes = head
            size = st.st_size - header_bytes
            meta = ArtifactMeta(key, size, digest, recompute_s, load_s, 0, 0.0, Tier.SSD)
            found.append((st.st_mtime, meta, path))
        found.sort(key=lambda f: f[0], reverse=True)
        keys: list[str] = []
        now = self.clock()
        for _, meta, path in found:
            if self._ssd_bytes + meta.size_bytes > self.ssd_capacity_bytes:
                with contextlib.suppress(OSError):
                    path.unlink()
                self._dropped += 1
                continue
            self._meta[meta.key] = replace(meta, last_access_s=now)
            self._ssd_bytes += meta.size_bytes
            keys.append(meta.key)
        return keys

    def _victims(self, tier: Tier, bytes_needed: int, protect: str) -> list[str]:
        now = self.clock()
        ranked = sorted(
            (m for m in self._meta.values() if m.tier is tier and m.key != protect),
            key=lambda m: artifact_utility(m, now, half_life_s=self.half_life_s),
        )
        out: list[str] = []
        freed = 0
        for m in ranked:
            if freed >= bytes_needed:
                break
            out.append(m.key)
            freed += m.size_bytes
        return out

    def _make_room(self, tier: Tier, size: int, protect: str) -> None:
        if tier is Tier.MEMORY:
            need = self._mem_bytes + size - self.memory_capacity_bytes
            for key in self._victims(Tier.MEMORY, need, protect) if need > 0 else []:
                self._demote(key)
        else:
            need = self._ssd_bytes + size - self.ssd_capacity_bytes
            for key in self._victims(Tier.SSD, need, protect) if need > 0 else []:
                self.delete(key)
                self._dropped += 1

    def _demote(self, key: str) -> None:
        meta = self._meta[key]
        data = self._memory_bytes_of(key)
        self._forget_memory(key)
        self._mem_bytes -= meta.size_bytes
        if self.ssd_dir is None or meta.size_bytes > self.ssd_capacity_bytes:
            del self._meta[key]
            self._dropped += 1
            return
        self._make_room(Tier.SSD, meta.size_bytes, protect=key)
        self._write_ssd(meta, data)
        self._meta[key] = replace(meta, tier=Tier.SSD)
        self._demoted += 1
