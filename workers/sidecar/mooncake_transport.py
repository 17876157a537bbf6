"""Artifact transport between sidecars over Mooncake Transfer Engine (TCP here, RDMA in
production): the same `TransportServer(store)` / `fetch(...)` / `TransferError` contract as the
plain-TCP `workers.sidecar.transport`, with the payload bytes moved by the engine's one-sided
reads instead of the control socket.

Two paths. **Direct** (one-sided, no control round trip): when both stores keep their memory
tier in an arena (`workers.sidecar.arena`, registered with the engine once), the source pushes
a *catalog* to every peer that watches it (`{"watch": true}` on a control connection): each
arena artifact's key, address, size and checksum, then every change, batched once per loop
turn, and an empty frame as a heartbeat every `CATALOG_HEARTBEAT_S`. A fetch of keys the
catalog lists reserves slots in the destination's arena, reads the bytes straight into them
(adjacent artifacts merged into one read, submissions hashed as they land), verifies and
commits them. Small fetches (`INLINE_READ_BYTES`) are read on the event loop itself (their
submissions awaited by polling), the others on a reading thread; one artifact of at most
`ONE_READ_BYTES` takes the shortest path (`_fetch_one`). Bytes that fail their checksum mean
the catalog was stale (the source evicted or replaced the artifact since its last push): those
keys take the control path, as do keys the catalog does not list yet, and every key after a
failed engine read.

    catalog:  {"catalog": engine session id, "put": [[key, address, size, checksum hex], ...],
               "gone": [key, ...]}     (source -> watching peer; the first frames list all)

**Control** path, one fetch (FlexKV's staged transfer, a 3FS KV connector's batched key lookup):

1. The destination opens a control connection (length-prefixed JSON frames, the helpers of
   `transport.py`; kept and reused for later fetches from the same peer) and asks for its keys.
2. The source takes a *region* of its staging buffer (a bounded, engine-registered memory area,
   `MooncakeSettings.staging_bytes`, split into regions of `region_bytes`), copies the next
   artifacts into it back to back (many small artifacts share one region; an artifact larger than
   a batch is chunked over several batches) and answers one batch frame: its engine session id,
   the artifacts that start in this batch (index, size, checksum) or are missing, and where each
   part lies in its registered memory. Artifacts of `in_place_bytes` and more are not copied:
   arena artifacts are read where they lie, others are registered where they lie (and stay
   registered afterwards, within `pin_cache_bytes`, so serving them again costs no
   registration).
3. The destination reads the batch with the engine (all its reads submitted at once, in a
   thread) into its own registered memory: the packed small parts in one read of their span into
   a reused receive buffer (then copied out), large parts straight into the artifact's final
   buffer in 1 MiB pieces, each hashed on a verify thread as soon as it has landed (buffers of
   `PREFAULT_MIN` and more are faulted in ahead of the engine by helper threads). It
   acknowledges the batch, so the source frees the region (two batches in flight per request:
   the source stages batch k + 1 while batch k is read). A destination with an arena receives
   into slots of it (then committed), else into fresh buffers.
4. Every artifact is verified against the checksum the source stored with it before it enters the
   destination's store; a mismatch, a failed engine read, a closed control connection or a
   timeout is a `TransferError`, and only whole, verified artifacts are ever stored.

The source verifies what it reads on the host before serving it: artifacts outside the arena
(SSD files, memory that found no slot) go through `transport.read_for_transfer`, and one that
fails its checksum is dropped from the store and listed `missing`, so the destination keeps the
blocks before it instead of failing the fetch. Arena artifacts are served from the registered
memory where they lie (one-sided reads, or a staging copy) without a host read or a hash at the
source; the destination's check is their only one.

Control frames (u32 length + JSON, as in `transport.py`):

    request:  {"keys": [key, ...]}
    batch:    {"batch": k, "session": engine session id, "last": bool,
               "new": [[key index, size, checksum hex], ...], "missing": [key index, ...],
               "parts": [[key index, offset in artifact, length, source address], ...]}
    ack:      {"ack": k}          (destination -> source, after reading batch k)
    error:    {"error": message}  (source -> destination, bad request)

Measured with both ends on loopback (bench/history/sidecar.md): per-fetch and
per-artifact Python work bounds the direct path for small artifacts; fresh destination memory
and the control round trips bound the control path.

Requests that find no free region wait for one (a request never holds a region while waiting for
another, so concurrent requests cannot deadlock). One `TransferEngine` serves the whole process,
configured by the first `MooncakeSettings` used (`from_env()` by default: `OWNERSERVE_MOONCAKE_*`).

`AVAILABLE` / `UNAVAILABLE_REASON` say whether `mooncake.engine` imports here; this module itself
always imports (the sidecar picks it lazily for `--transport auto|mooncake`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import mmap
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.sidecar.arena import Arena
from workers.sidecar.store import (
    ArtifactCorrupted,
    ArtifactLocation,
    ArtifactMissing,
    ArtifactStore,
    checksum,
    new_hasher,
)
from workers.sidecar.transport import (
    FetchResult,
    TransferError,
    _frame,
    _read_frame,
    read_for_transfer,
)

__all__ = [
    "AVAILABLE",
    "UNAVAILABLE_REASON",
    "FetchResult",
    "MooncakeSettings",
    "TransferError",
    "TransportServer",
    "fetch",
]


def _probe() -> tuple[Any, str]:
    try:
        from mooncake.engine import TransferEngine
    except Exception as exc:  # ImportError, or OSError of a missing libibverbs
        return None, f"mooncake.engine does not import: {exc!r}"
    return TransferEngine, ""


_TransferEngine, UNAVAILABLE_REASON = _probe()
AVAILABLE: bool = _TransferEngine is not None

MiB = 1 << 20
DIRECT_MIN = 256 << 10
"""At the destination, artifacts at least this large are read straight into their final buffer
(registering local memory is cheap); smaller ones go through a reused receive buffer."""
MAX_SMALL_SPAN = 1 << 30
"""Sanity bound on the span of one batch's staged parts (the source keeps them in one region)."""
READ_CHUNK = 1 << 20
"""Large parts are read in pieces of this size, each hashed while the next one is read."""
INLINE_PIECE = 256 << 10
"""The same for direct reads on the event loop (`INLINE_READ_BYTES`), and for a one-call fetch
above this size (`_fetch_one`). 16-core host, one artifact read and hashed as 2 / 4 / 8 pieces
against one read then one hash, as a share of a raw read: 1 MiB 0.84-0.86 / 0.86-0.87 / 0.82-0.83
against 0.81-0.83; 2 MiB 0.83 / 0.90 / 0.90 against 0.82. Below 256 KiB a second submission
costs more than it overlaps (64 KiB: 0.81-0.83 as two pieces, 0.92 as one read)."""
SPIN_WAIT_S = 0.005
"""On the event loop, a one-segment submission is awaited by polling its status without pause
for up to this long from the first wait (`_await_read`), then with short sleeps. The engine's
blocking `get_batch_transfer_status` costs 6-8 us more per batch than polling (1 MiB reads on
the 2-core VM; it also writes an INFO log line for every batch it sees complete): awaited with
it, pieces cost more than the overlap of reading and hashing saved."""
LOOP_WAIT_S = 0.1
"""The longest reads on the event loop may hold it. Reads still running then (a source that
froze) are given up: a thread waits for the engine to let go of them (its own timeout,
`MC_TRANSFER_TIMEOUT`, is 30 s by default) and only then is their memory given back; the
fetch goes on as after a failed read (catalog dropped, control path)."""
POLL_SLEEP_S = 50e-6
READ_ABANDONED = -1000
"""`_read_all`'s answer when it gave reads up to a thread (`LOOP_WAIT_S`)."""
INLINE_HASH_BYTES = 256 << 10
"""A batch's packed small parts up to this size are hashed by the reading thread itself."""
MAX_ITEMS_PER_BATCH = 2048
"""Bounds a batch frame's header (each artifact costs ~100 bytes of JSON)."""
CATALOG_ENTRIES_PER_FRAME = 2048
"""Bounds a catalog frame likewise."""
CATALOG_HEARTBEAT_S = 0.5
"""A source sends its watchers an empty catalog frame after this long without a change."""
CATALOG_FRESH_S = 1.5
"""A catalog heard from within this long is fresh: its source is taken to be alive, and
small direct reads from it run on the event loop itself (see `INLINE_READ_BYTES`)."""
MAX_CATALOG_BACKLOG = 16 * MiB
"""A watching peer whose unread catalog frames exceed this is disconnected."""
INLINE_READ_BYTES = 4 * MiB
"""A direct fetch of at most this many bytes from a source whose catalog is fresh is read on
the event loop itself: one engine call, like a raw read (the hop to a reading thread and back
costs more than such a read: 4 KiB in ~0.1 ms), in submissions of `INLINE_PIECE`, each
hashed while the engine reads the next (when each submission is one contiguous range at both
ends; scattered ones go to a reading thread). The price: a source that freezes within
`CATALOG_FRESH_S` of such a read stalls this loop for `LOOP_WAIT_S`, once; its catalog is
dropped then."""
ONE_READ_BYTES = 1 * MiB
"""A fetch of one listed artifact up to this size takes the shortest path (`_fetch_one`): up to
`INLINE_PIECE`, one engine read on the loop and one checksum call after it; above, pieces of
`INLINE_PIECE` submitted at once and each hashed as soon as it has landed."""
_WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """How this process's Transfer Engine runs and how big the source's staging buffer is."""

    protocol: str = "tcp"
    """"tcp" (works anywhere) or "rdma" (production NICs)."""
    metadata: str = "P2PHANDSHAKE"
    """Engine metadata: peer-to-peer handshake, or a metadata server URL."""
    device_name: str = ""
    """RDMA device filter (e.g. "mlx5_0"); empty for TCP or auto-detection."""
    local_hostname: str = ""
    """Address peers reach this engine at; empty: the host the server binds (for a wildcard,
    the address of the default route), else the address the first control connection left
    from."""
    staging_bytes: int = 256 * MiB
    region_bytes: int = 16 * MiB
    batch_bytes: int = 16 * MiB
    """Bytes per batch frame and acknowledgement (at most `region_bytes`)."""
    in_place_bytes: int = 4 * MiB
    """Artifacts at least this large are registered where they lie instead of being copied into
    staging: no copy, but the peer's first read of a newly registered buffer refreshes the
    engine's segment metadata (~0.5-3 ms measured on loopback), which a copy of a few MiB beats."""
    hash_threads: int = 0
    """Threads that verify checksums; 0 = min(4, CPU count)."""
    pin_cache_bytes: int = 256 * MiB
    """In-place registrations of artifacts no request uses any more stay, up to this many bytes
    (oldest dropped first), so serving the same artifact again needs no new registration; the
    cache keeps those bytes alive even after the store dropped them. 0 unregisters at once."""

    def __post_init__(self) -> None:
        if self.region_bytes <= 0 or self.staging_bytes < 2 * self.region_bytes:
            raise ValueError("staging_bytes must hold at least two regions of region_bytes > 0")
        if self.batch_bytes <= 0:
            raise ValueError("batch_bytes must be > 0")
        if self.pin_cache_bytes < 0:
            raise ValueError("pin_cache_bytes must be >= 0")

    @classmethod
    def from_env(cls) -> MooncakeSettings:
        env = os.environ
        return cls(
            protocol=env.get("OWNERSERVE_MOONCAKE_PROTOCOL", "tcp"),
            metadata=env.get("OWNERSERVE_MOONCAKE_METADATA", "P2PHANDSHAKE"),
            device_name=env.get("OWNERSERVE_MOONCAKE_DEVICE", ""),
            local_hostname=env.get("OWNERSERVE_MOONCAKE_HOST", ""),
            staging_bytes=int(env.get("OWNERSERVE_MOONCAKE_STAGING_BYTES", 256 * MiB)),
            region_bytes=int(env.get("OWNERSERVE_MOONCAKE_REGION_BYTES", 16 * MiB)),
            batch_bytes=int(env.get("OWNERSERVE_MOONCAKE_BATCH_BYTES", 16 * MiB)),
            in_place_bytes=int(env.get("OWNERSERVE_MOONCAKE_IN_PLACE_BYTES", 4 * MiB)),
            hash_threads=int(env.get("OWNERSERVE_MOONCAKE_HASH_THREADS", 0)),
            pin_cache_bytes=int(env.get("OWNERSERVE_MOONCAKE_PIN_CACHE_BYTES", 256 * MiB)),
        )


# --- the process's engine -------------------------------------------------------------------


def _probe_bytes_offset() -> int:
    probe = b"where does a bytes object keep its data?"
    addr = ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p).value
    assert addr is not None
    return addr - id(probe)


_BYTES_DATA_OFFSET = _probe_bytes_offset()  # CPython: id() is the object's address


def _address_of(buf: bytes | mmap.mmap) -> int:
    """Where the bytes of `buf` lie in memory (for the engine)."""
    if isinstance(buf, bytes):
        return id(buf) + _BYTES_DATA_OFFSET
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


_HUGE = 2 << 20
try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _MADV_HUGEPAGE: int | None = mmap.MADV_HUGEPAGE
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _MADV_HUGEPAGE = None


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing them
PREFAULT_MIN = 8 << 20
"""Buffers at least this large are faulted in ahead of the engine by helper threads (hosts of
4 or more CPUs), in pieces of `_PREFAULT_PIECE`: faulting fresh memory (the kernel zeroes every
page) costs as much as writing it, 16 ms for 64 MiB measured on a 16-core host."""
_PREFAULT_PIECE = 4 << 20
_PREFAULT_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _prefault_threads() -> int:
    """Helper threads for faulting in (0 on hosts of fewer than 4 CPUs: they would compete with
    the engine's own threads for the cores)."""
    cpus = os.cpu_count() or 1
    return min(4, cpus - 2) if cpus >= 4 else 0


def _populate(obj: bytes, addr: int, n: int) -> None:
    """Fault in [addr, addr + n) of `obj`, which the pool's job holds (and so keeps alive) for
    as long as this runs."""
    assert obj
    _libc.madvise(addr, n, _MADV_POPULATE_WRITE)  # advice only: failure is harmless


def _prefault(obj: bytes, lo: int, hi: int) -> None:
    """Fault [lo, hi) of `obj`'s memory in on helper threads, front first (the engine writes
    from the front: a page either side touches first is simply there for the other)."""
    if not _PREFAULT_POOL:
        threads = _prefault_threads()
        if threads == 0:
            return
        _PREFAULT_POOL.append(
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mooncake-fault")
        )
    pool = _PREFAULT_POOL[0]
    for start in range(lo, hi, _PREFAULT_PIECE):
        pool.submit(_populate, obj, start, min(_PREFAULT_PIECE, hi - start))


def _uninitialized_bytes(size: int) -> bytes:
    """A fresh `bytes` of `size` unset bytes, filled in place before anyone else sees it
    (CPython's own idiom for building bytes in C); it saves a copy of every large artifact.
    Large ones ask for transparent huge pages (untouched yet): writing fresh memory costs a page
    fault per 4 KiB otherwise, measured ~3 ms per 16 MiB here, ~1 ms with huge pages; from
    `PREFAULT_MIN` on, helper threads fault the pages in ahead of the engine."""
    obj = _new_bytes(None, size)
    assert isinstance(obj, bytes)
    if size >= 2 * _HUGE and _MADV_HUGEPAGE is not None:
        addr = _address_of(obj)
        lo = (addr + _HUGE - 1) & ~(_HUGE - 1)
        hi = (addr + size) & ~(_HUGE - 1)
        if hi > lo:
            _libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: failure is harmless
            if size >= PREFAULT_MIN:
                _prefault(obj, lo, hi)
    return obj


class _Engine:
    """The process's TransferEngine plus the bookkeeping both roles share."""

    def __init__(self, settings: MooncakeSettings, hostname: str) -> None:
        if _TransferEngine is None:
            raise TransferError(f"Mooncake Transfer Engine is unavailable: {UNAVAILABLE_REASON}")
        self.settings = settings
        self.hostname = hostname
        self.te = _TransferEngine()
        rc = self.te.initialize(
            hostname, settings.metadata, settings.protocol, settings.device_name
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake engine initialize({hostname!r}, {settings.metadata!r}, "
                f"{settings.protocol!r}) failed: {rc}"
            )
        if settings.metadata == "P2PHANDSHAKE":
            self.session_id = f"{_host_for_url(hostname)}:{self.te.get_rpc_port()}"
        else:
            self.session_id = hostname
        self.hash_threads = settings.hash_threads or min(4, os.cpu_count() or 1)
        self.hash_pool = concurrent.futures.ThreadPoolExecutor(
            self.hash_threads,
            thread_name_prefix="mooncake-verify",
        )
        self.read_pool = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="mooncake-read"
        )
        # waits out reads the event loop gave up on (a frozen source: rare, and long)
        self.settle_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mooncake-settle"
        )
        self._recv_lock = threading.Lock()
        self._recv_free: list[_Buffer] = []
        self._pin_lock = threading.Lock()
        self._pins: dict[int, tuple[bytes, int]] = {}
        # registrations of artifacts no request uses now, kept for the next one (oldest first)
        self._idle_pins: OrderedDict[int, bytes] = OrderedDict()
        self._idle_bytes = 0
        self._arenas: dict[int, Arena] = {}  # registered for good (their memory never goes)

    def register_arena(self, arena: Arena) -> int:
        """Register a store's arena once (idempotent); returns its address."""
        if id(arena) in self._arenas:
            return arena.addr
        with self._pin_lock:
            if id(arena) not in self._arenas:
                self.register(arena.addr, arena.size)
                self._arenas[id(arena)] = arena
        return arena.addr

    def register(self, addr: int, size: int) -> None:
        rc = self.te.register_memory(addr, size, "cpu:0")
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {size} bytes failed: {rc}")

    def unregister(self, addr: int) -> None:
        self.te.unregister_memory(addr)

    def pin(self, data: bytes) -> int:
        """Register an artifact's bytes in place (shared by concurrent requests: counted).
        An artifact served recently is still registered (`unpin`): no new registration, and
        peers need no fresh segment metadata to read it."""
        addr = _address_of(data)
        with self._pin_lock:
            held = self._pins.get(addr)
            if held is not None:
                self._pins[addr] = (data, held[1] + 1)
                return addr
            # the cache holds its bytes alive, so an entry at this address is this very object
            idle = self._idle_pins.pop(addr, None)
            if idle is not None:
                self._idle_bytes -= len(idle)
            else:
                self.register(addr, len(data))
            self._pins[addr] = (data, 1)
        return addr

    def unpin(self, addr: int) -> None:
        """Drop a request's hold; the last one leaves the registration (and the bytes) in a
        cache of `MooncakeSettings.pin_cache_bytes`, oldest unregistered first."""
        with self._pin_lock:
            data, n = self._pins[addr]
            if n > 1:
                self._pins[addr] = (data, n - 1)
                return
            del self._pins[addr]
            self._idle_pins[addr] = data
            self._idle_bytes += len(data)
            while self._idle_bytes > self.settings.pin_cache_bytes:
                old, old_data = self._idle_pins.popitem(last=False)
                self._idle_bytes -= len(old_data)
                self.unregister(old)

    # receive buffers: registered, reused (warm pages), returned by the thread that read into them
    def take_receive_buffer(self, size: int) -> _Buffer:
        with self._recv_lock:
            for i, buf in enumerate(self._recv_free):
                if buf.size >= size:
                    return self._recv_free.pop(i)
        return _Buffer(self, max(size, 4 * MiB))

    def give_back_receive_buffer(self, buf: _Buffer) -> None:
        with self._recv_lock:
            if len(self._recv_free) < 4:
                self._recv_free.append(buf)
                return
        buf.retire()


_ENGINE: _Engine | None = None
_ENGINE_LOCK = threading.Lock()
_RETIRED: list[mmap.mmap] = []


def _host_for_url(host: str) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def _primary_address() -> str:
    """This host's address on its default route (peers must reach the engine there; a server
    bound to a wildcard cannot advertise that). UDP connect sends nothing."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route
        address = str(s.getsockname()[0])
        if address != "0.0.0.0":
            return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _engine(settings: MooncakeSettings | None, hostname_hint: str) -> _Engine:
    """The process's engine, created on first use (later settings are ignored)."""
    global _ENGINE
    if _ENGINE is not None:
        return _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            s = settings or MooncakeSettings.from_env()
            host = s.local_hostname or hostname_hint
            if host in _WILDCARDS:
                host = _primary_address()
            _ENGINE = _Engine(s, host)
        return _ENGINE


class _Buffer:
    """Anonymous memory (pages are only backed once written) registered with the engine."""

    def __init__(self, engine: _Engine, size: int) -> None:
        self.engine = engine
        self.size = size
        self.mem = mmap.mmap(-1, size)
        self.addr = _address_of(self.mem)
        self.view = memoryview(self.mem)
        engine.register(self.addr, size)

    def retire(self) -> None:
        """Unregister and give the pages back. The mapping itself stays (a peer's read racing
        the unregister reads zeros, never unmapped memory)."""
        self.engine.unregister(self.addr)
        self.view.release()
        with contextlib.suppress(ValueError, OSError):
            self.mem.madvise(mmap.MADV_DONTNEED)
        _RETIRED.append(self.mem)


# --- source side ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Lease:
    """What one batch in flight holds at the source until the peer acknowledges it: a staging
    region (for small artifacts) and in-place registrations (large artifacts whose last part it
    carries)."""

    region: int | None = None
    pins: list[int] = field(default_factory=list)


def _copy_all(copies: Sequence[tuple[int, int, int, object]]) -> None:
    """(destination, source address, length, the object that keeps the source alive)."""
    for dst, src, n, _ in copies:
        ctypes.memmove(dst, src, n)


PIN_GRACE_S = 40.0
"""After a peer vanished mid-batch, in-place registrations stay (and their bytes alive) this
long: longer than the engine's own 30 s no-progress limit on a read still in flight."""


class TransportServer:
    """Serves artifacts of a store to peers: control over TCP, bytes through the engine."""

    def __init__(self, store: ArtifactStore, *, settings: MooncakeSettings | None = None) -> None:
        self.store = store
        self.settings = settings
        self._server: asyncio.Server | None = None
        self._engine: _Engine | None = None
        self._staging: _Buffer | None = None
        self._free: asyncio.LifoQueue[int] | None = None
        self._region_bytes = 0
        self._batch_bytes = 0
        self._in_place_bytes = 0
        self._handlers: set[asyncio.Task[None]] = set()
        self._peers: set[asyncio.StreamWriter] = set()
        self._arena_addr = 0
        self._watchers: set[asyncio.StreamWriter] = set()
        self._changes: dict[str, ArtifactLocation | None] = {}
        self._unwatch: Callable[[], None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._engine = _engine(self.settings, host)
        s = self.settings or self._engine.settings
        self._region_bytes = s.region_bytes
        self._batch_bytes = min(s.batch_bytes, s.region_bytes)
        self._in_place_bytes = s.in_place_bytes
        regions = s.staging_bytes // s.region_bytes
        self._staging = _Buffer(self._engine, regions * s.region_bytes)
        self._free = asyncio.LifoQueue()  # the last region freed is warm: reuse it first
        for i in range(regions):
            self._free.put_nowait(i)
        if self.store.arena is not None:
            self._arena_addr = self._engine.register_arena(self.store.arena)
            self._unwatch = self.store.watch(self._changed)
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._server is not None:
            self._server.close()
            for writer in list(self._peers):  # their handlers end on the closed connection
                writer.transport.abort()
            if self._handlers:
                await asyncio.wait(list(self._handlers), timeout=5.0)
            await self._server.wait_closed()
            self._server = None
        if self._staging is not None:
            self._staging.retire()
            self._staging = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._engine is not None and self._free is not None
        engine, free = self._engine, self._free
        self._handlers.add(task)
        self._peers.add(writer)
        held: deque[_Lease] = deque()
        open_pins: list[int] = []  # in-place artifacts whose last part is not sent yet
        try:
            while True:
                try:
                    req = await _read_frame(reader)
                except asyncio.IncompleteReadError:
                    return
                if req.get("watch") is True:  # (a source without an arena lists nothing)
                    await self._stream_catalog(reader, writer)
                    return
                keys = req.get("keys")
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    writer.write(_frame({"error": "request needs 'keys': [str, ...]"}))
                    await writer.drain()
                    return
                await self._serve(keys, reader, writer, held, open_pins)
        except (asyncio.IncompleteReadError, OSError, TransferError, ValueError):
            return
        finally:
            self._handlers.discard(task)
            self._peers.discard(writer)
            # the peer is gone or done; a read of it may still be in flight: regions go back
            # (a late read gets other bytes and fails its checksum), in-place bytes stay
            # registered and alive for a grace period
            pins = [addr for lease in held for addr in lease.pins] + open_pins
            for lease in held:
                if lease.region is not None:
                    free.put_nowait(lease.region)
            if pins:

                def unpin_all() -> None:
                    for addr in pins:
                        engine.unpin(addr)

                asyncio.get_running_loop().call_later(PIN_GRACE_S, unpin_all)
            writer.close()

    # --- the catalog: arena locations pushed to the peers that watch -------------------------

    def _catalog_frames(self, entries: Sequence[tuple[str, ArtifactLocation | None]]) -> bytes:
        assert self._engine is not None
        out = []
        for i in range(0, max(1, len(entries)), CATALOG_ENTRIES_PER_FRAME):
            put, gone = [], []
            for key, where in entries[i : i + CATALOG_ENTRIES_PER_FRAME]:
                if where is None:
                    gone.append(key)
                else:
                    addr = self._arena_addr + where.offset
                    put.append([key, addr, where.size_bytes, where.checksum.hex()])
            frame = {"catalog": self._engine.session_id, "put": put, "gone": gone}
            out.append(_frame(frame))
        return b"".join(out)

    async def _stream_catalog(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A watching peer: every arena location now, then every change, until it hangs up."""
        snapshot = [(loc.key, loc) for loc in self.store.locations()]
        writer.write(self._catalog_frames(snapshot))
        self._watchers.add(writer)
        heartbeat = self._catalog_frames([])
        try:
            await writer.drain()
            while True:  # the peer sends nothing more; EOF ends the stream
                try:
                    async with asyncio.timeout(CATALOG_HEARTBEAT_S):
                        if not await reader.read(4096):
                            return
                except TimeoutError:  # nothing to say: say that this source is alive
                    if writer.transport.get_write_buffer_size() > MAX_CATALOG_BACKLOG:
                        return
                    writer.write(heartbeat)
        finally:
            self._watchers.discard(writer)

    def _changed(self, key: str, where: ArtifactLocation | None) -> None:
        """Store watcher: collect changes, pushed to the watching peers once per loop turn."""
        if not self._watchers:
            return
        if not self._changes:
            asyncio.get_running_loop().call_soon(self._push_changes)
        self._changes[key] = where

    def _push_changes(self) -> None:
        data = self._catalog_frames(list(self._changes.items()))
        self._changes.clear()
        for writer in list(self._watchers):
            if writer.transport.get_write_buffer_size() > MAX_CATALOG_BACKLOG:
                writer.transport.abort()  # a peer that does not read: it re-subscribes anew
                self._watchers.discard(writer)
            else:
                writer.write(data)

    async def _serve(
        self,
        keys: list[str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        held: deque[_Lease],
        open_pins: list[int],
    ) -> None:
        assert self._engine is not None and self._staging is not None and self._free is not None
        engine, free, region_bytes = self._engine, self._free, self._region_bytes
        sent = acked = 0

        async def take_ack() -> None:
            nonlocal acked
            ack = await _read_frame(reader)
            if ack.get("ack") != acked:
                raise TransferError(f"peer acknowledged {ack.get('ack')!r}, expected {acked}")
            acked += 1
            lease = held.popleft()
            if lease.region is not None:
                free.put_nowait(lease.region)
            for addr in lease.pins:
                engine.unpin(addr)

        nxt = 0  # next key to look up
        # the artifact being sent: key index, size, bytes sent, where its bytes lie, whether it
        # is served in place (from that address) and pinned (registered for this request)
        current: tuple[int, int, int, int, bool, bool] | None = None
        keep: object = None  # keeps the bytes of the artifact being sent alive
        while True:
            while len(held) >= 2:
                await take_ack()
            lease = _Lease()
            held.append(lease)
            new: list[list[object]] = []
            missing: list[int] = []
            parts: list[list[int]] = []
            copies: list[tuple[int, int, int, object]] = []
            budget = self._batch_bytes  # bytes per batch, staged or in place
            staged = 0
            while budget > 0 and len(parts) + len(new) + len(missing) < MAX_ITEMS_PER_BATCH:
                if current is None:
                    if nxt == len(keys):
                        break
                    where = self.store.location(keys[nxt], touch=True)
                    if where is not None:  # in the registered arena: no registration needed
                        size, digest = where.size_bytes, where.checksum
                        src = self._arena_addr + where.offset
                        keep, pinned = self.store.arena, False
                    else:
                        try:
                            data, digest = await read_for_transfer(self.store, keys[nxt])
                        except (ArtifactMissing, ArtifactCorrupted):
                            missing.append(nxt)
                            nxt += 1
                            continue
                        keep = data = bytes(data)
                        size, pinned = len(data), len(data) >= self._in_place_bytes
                        src = engine.pin(data) if pinned else _address_of(data)
                        if pinned:
                            open_pins.append(src)
                    new.append([nxt, size, digest.hex()])
                    current = (nxt, size, 0, src, size >= self._in_place_bytes, pinned)
                    nxt += 1
                idx, size, pos, src, in_place, pinned = current
                n = min(size - pos, budget)
                if n and in_place:
                    parts.append([idx, pos, n, src + pos])
                elif n:
                    if lease.region is None:
                        if free.empty() and parts:
                            break  # send what is ready; stage these once a region is free
                        while free.empty() and any(x.region is not None for x in held):
                            await take_ack()  # never wait for a region while holding one
                        lease.region = await free.get()
                    dst = self._staging.addr + lease.region * region_bytes + staged
                    parts.append([idx, pos, n, dst])
                    copies.append((dst, src + pos, n, keep))
                    staged += n
                budget -= n
                if pos + n == size:
                    current = None
                    if pinned:
                        open_pins.remove(src)
                        lease.pins.append(src)
                else:
                    current = (idx, size, pos + n, src, in_place, pinned)
            if staged > MiB:
                await asyncio.to_thread(_copy_all, copies)
            else:
                _copy_all(copies)
            last = current is None and nxt == len(keys)
            writer.write(
                _frame(
                    {
                        "batch": sent,
                        "session": engine.session_id,
                        "new": new,
                        "missing": missing,
                        "parts": parts,
                        "last": last,
                    }
                )
            )
            await writer.drain()
            sent += 1
            if last:
                break
        while held:
            await take_ack()


# --- destination side -----------------------------------------------------------------------


@dataclass(slots=True)
class _Incoming:
    """One artifact being received: its final buffer, checksum state and last hash job."""

    key: str
    size: int
    expected: bytes
    data: bytes | memoryview
    addr: int
    direct: bool = False  # read straight into `data` (else through a receive buffer)
    registered: bool = False  # `data` registered for this artifact alone (unregister after)
    slot: int | None = None  # the destination store's arena slot `data` lies in, until stored
    hasher: Any = field(default_factory=new_hasher)
    received: int = 0
    hashed: concurrent.futures.Future[None] | None = None


def _hash_parts(
    updates: Sequence[tuple[Any, memoryview]],
    waits: Sequence[concurrent.futures.Future[None]],
) -> None:
    for w in waits:  # earlier parts of the same artifacts (submitted before this job)
        w.result()
    for hasher, view in updates:
        hasher.update(view)


def _hash_later(engine: _Engine, inc: _Incoming, pos: int, n: int) -> None:
    """Queue the hashing of inc.data[pos:pos + n] after the artifact's earlier parts."""
    prev = inc.hashed
    view = memoryview(inc.data)[pos : pos + n]
    inc.hashed = engine.hash_pool.submit(_hash_parts, [(inc.hasher, view)], [prev] if prev else [])


@dataclass(slots=True)
class _ReadPlan:
    """What one batch's engine reads bring: large parts straight into their artifacts, the
    small ones as one packed run through a receive buffer."""

    session: str
    direct: list[tuple[_Incoming, int, int, int]]  # artifact, offset, length, remote address
    small: list[tuple[_Incoming, int, int, int]]
    recv: _Buffer | None = None
    lo: int = 0
    span: int = 0


def _read_batch(engine: _Engine, plan: _ReadPlan) -> int:
    """Blocking: the batch's engine reads, all submitted at once (the engine moves them in
    parallel), then awaited in order, each piece hashed as soon as it has landed (so verifying
    overlaps the rest of the transfer). Returns 0, or the engine's failure status. It returns
    only once the engine has stopped writing into the plan's buffers (the plan holds them until
    then); the receive buffer goes back to the pool only here, for the same reason."""
    te = engine.te
    pieces: list[tuple[int, int, int, _Incoming | None]] = []  # local, remote, length, artifact
    for target, pos, n, remote in plan.direct:
        for off in range(0, n, READ_CHUNK):
            pieces.append((target.addr + pos + off, remote + off, min(READ_CHUNK, n - off), target))
    if plan.recv is not None:
        pieces.append((plan.recv.addr, plan.lo, plan.span, None))

    def landed(i: int) -> None:
        local, _, n, artifact = pieces[i]
        if artifact is not None:
            _hash_later(engine, artifact, local - artifact.addr, n)

    try:
        rc = _read_all(
            te, plan.session, [([lo], [re], [n]) for lo, re, n, _ in pieces], landed, False
        )
        if rc == 0 and plan.recv is not None:
            _land_small(engine, plan)
        return rc
    finally:
        if plan.recv is not None:
            engine.give_back_receive_buffer(plan.recv)


def _land_small(engine: _Engine, plan: _ReadPlan) -> None:
    """Copy the packed small parts out of the receive buffer and hash them."""
    assert plan.recv is not None
    recv = plan.recv
    for inc, pos, n, remote in plan.small:
        ctypes.memmove(inc.addr + pos, recv.addr + remote - plan.lo, n)
    if plan.span <= INLINE_HASH_BYTES:  # cheaper here than a hop to another thread
        for inc, pos, n, _ in plan.small:
            if inc.hashed is not None:
                inc.hashed.result()
                inc.hashed = None
            inc.hasher.update(memoryview(inc.data)[pos : pos + n])
        return
    # one job per verify thread (an artifact has one part per batch)
    groups = engine.hash_threads
    updates: list[list[tuple[Any, memoryview]]] = [[] for _ in range(groups)]
    waits: list[list[concurrent.futures.Future[None]]] = [[] for _ in range(groups)]
    for j, (inc, pos, n, _) in enumerate(plan.small):
        if inc.hashed is not None:
            waits[j % groups].append(inc.hashed)
        updates[j % groups].append((inc.hasher, memoryview(inc.data)[pos : pos + n]))
    jobs = [
        engine.hash_pool.submit(_hash_parts, updates[g], waits[g])
        for g in range(min(groups, len(plan.small)))
    ]
    for j, (inc, *_) in enumerate(plan.small):
        inc.hashed = jobs[j % groups]


@dataclass(slots=True)
class _Batch:
    """A batch frame, checked: artifacts it starts, keys the source lacks, and parts as
    (key index, offset in the artifact, length, address in the source's registered memory)."""

    number: int
    session: str
    new: list[tuple[int, int, bytes]]
    missing: list[int]
    parts: list[tuple[int, int, int, int]]
    last: bool

    @classmethod
    def parse(cls, frame: dict[str, object], n_keys: int) -> _Batch:
        if "error" in frame:
            raise TransferError(f"peer refused: {frame['error']}")
        try:
            number, session = frame["batch"], frame["session"]
            assert isinstance(number, int) and isinstance(session, str)
            new = [(int(i), int(n), bytes.fromhex(d)) for i, n, d in frame["new"]]  # type: ignore[attr-defined]
            missing = [int(i) for i in frame["missing"]]  # type: ignore[attr-defined]
            parts = [
                (int(i), int(p), int(n), int(a))
                for i, p, n, a in frame["parts"]  # type: ignore[attr-defined]
            ]
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise TransferError(f"bad batch frame: {e!r}") from None
        idx = [i for i, _, _ in new] + missing + [p[0] for p in parts]
        if any(not 0 <= i < n_keys for i in idx) or any(n < 0 for _, n, _ in new):
            raise TransferError("bad batch frame: index or size out of range")
        if any(n <= 0 or a <= 0 for _, _, n, a in parts):
            raise TransferError("bad batch frame: empty part or bad address")
        return cls(number, session, new, missing, parts, bool(frame.get("last")))


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_IDLE: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], list[_Conn]]]
_IDLE = weakref.WeakKeyDictionary()
MAX_IDLE_PER_PEER = 4
"""Control connections kept open per peer (and event loop) between fetches."""


class _StaleConnection(Exception):
    """A pooled control connection the peer had closed before this fetch used it."""


def _take_idle(host: str, port: int) -> _Conn | None:
    conns = _IDLE.get(asyncio.get_running_loop(), {}).get((host, port))
    while conns:
        reader, writer = conns.pop()
        if not writer.is_closing() and not reader.at_eof() and reader.exception() is None:
            return reader, writer
        writer.close()
    return None


def _give_back(host: str, port: int, conn: _Conn) -> None:
    reader, writer = conn
    conns = _IDLE.setdefault(asyncio.get_running_loop(), {}).setdefault((host, port), [])
    if writer.is_closing() or reader.at_eof() or len(conns) >= MAX_IDLE_PER_PEER:
        writer.close()
    else:
        conns.append(conn)


# --- the catalog of a peer, and direct reads ------------------------------------------------


class _Catalog:
    """What one peer's arena holds, as it pushes it (`{"watch": true}` on a control
    connection): key -> (engine session, address, size, checksum). A background task keeps it
    current; when the connection ends the catalog is dropped (the next fetch watches anew)."""

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop) -> None:
        self.host, self.port, self.loop = host, port, loop
        self.entries: dict[str, tuple[str, int, int, bytes]] = {}
        self.task: asyncio.Task[None] | None = None
        self.heard_s = 0.0  # when the source last sent a frame (time.monotonic)

    def fresh(self) -> bool:
        return time.monotonic() - self.heard_s < CATALOG_FRESH_S

    def drop(self) -> None:
        """Forget this catalog (after a failed read): the next fetch watches anew."""
        self.entries = {}
        if self.task is not None:
            self.task.cancel()

    async def run(self, registry: dict[tuple[str, int], _Catalog]) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(CATALOG_CONNECT_TIMEOUT_S):
                reader, w = await asyncio.open_connection(self.host, self.port)
            writer = w
            w.write(_frame({"watch": True}))
            await w.drain()
            while True:
                self.apply(await _read_frame(reader))
                self.heard_s = time.monotonic()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, TransferError, ValueError):
            pass  # no catalog: fetches from this peer go through the control path
        finally:
            self.entries = {}
            if registry.get((self.host, self.port)) is self:
                del registry[(self.host, self.port)]
            if writer is not None:
                writer.close()

    def apply(self, frame: dict[str, object]) -> None:
        session, put, gone = frame.get("catalog"), frame.get("put"), frame.get("gone")
        if not isinstance(session, str) or not isinstance(put, list) or not isinstance(gone, list):
            raise TransferError("bad catalog frame")
        entries = self.entries
        for key in gone:
            entries.pop(key, None)
        for entry in put:
            try:
                key, addr, size, digest = entry
                where = (session, int(addr), int(size), bytes.fromhex(digest))
            except (TypeError, ValueError):
                raise TransferError(f"bad catalog entry {entry!r:.200}") from None
            if not isinstance(key, str) or where[1] <= 0 or where[2] <= 0:
                raise TransferError(f"bad catalog entry {entry!r:.200}")
            entries.pop(key, None)  # a replaced artifact counts as new (kept longest)
            entries[key] = where
        while len(entries) > MAX_CATALOG_ENTRIES:  # the source's oldest: the control path's
            del entries[next(iter(entries))]


CATALOG_CONNECT_TIMEOUT_S = 5.0
MAX_CATALOG_ENTRIES = 1 << 18
"""Entries kept per watched source (~250 bytes each: ~64 MiB); beyond it the oldest go (fetches
of those take the control path)."""
_CATALOGS: dict[tuple[str, int], _Catalog] = {}


def _catalog(host: str, port: int) -> _Catalog:
    """The catalog of the peer at host:port, watched from now on (empty until it arrives)."""
    loop = asyncio.get_running_loop()
    cat = _CATALOGS.get((host, port))
    if cat is None or cat.loop is not loop:  # (one from a loop that has ended is replaced)
        cat = _CATALOGS[(host, port)] = _Catalog(host, port, loop)
        cat.task = loop.create_task(cat.run(_CATALOGS))
    return cat


@dataclass(slots=True)
class _Group:
    """One engine submission of a direct fetch: its segments (local address, remote address,
    length) and the (artifact, offset, length) spans they bring, in order."""

    local: list[int] = field(default_factory=list)
    remote: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    spans: list[tuple[_Incoming, int, int]] = field(default_factory=list)
    bytes: int = 0


@dataclass(slots=True)
class _Direct:
    """A direct fetch from one engine session: the catalog entries to read one-sided into
    reserved arena slots, and the engine submissions that bring them."""

    session: str
    items: list[_Incoming]
    remote: list[int]
    groups: list[_Group] = field(default_factory=list)


def _plan_direct(d: _Direct, piece: int) -> None:
    """Merge reads that are adjacent at both ends (artifacts stored one after another), then
    pack them into submissions of `piece` bytes (a longer run is cut), so each submission is
    hashed while the next ones are read."""
    if len(d.items) == 1 and d.items[0].size <= piece:  # the common small fetch, directly
        inc = d.items[0]
        d.groups = [_Group([inc.addr], d.remote, [inc.size], [(inc, 0, inc.size)], inc.size)]
        return
    runs: list[tuple[int, int, int, list[_Incoming]]] = []
    for inc, remote in zip(d.items, d.remote, strict=True):
        if runs:
            local0, remote0, n0, incs = runs[-1]
            if local0 + n0 == inc.addr and remote0 + n0 == remote:
                incs.append(inc)
                runs[-1] = (local0, remote0, n0 + inc.size, incs)
                continue
        runs.append((inc.addr, remote, inc.size, [inc]))
    groups = [_Group()]
    for local, remote, n, incs in runs:
        i = at = done = 0  # artifact of the run, offset in it, bytes of the run planned
        while done < n:
            g = groups[-1]
            if g.bytes >= piece:
                g = _Group()
                groups.append(g)
            k = min(piece - g.bytes, n - done)
            g.local.append(local + done)
            g.remote.append(remote + done)
            g.length.append(k)
            g.bytes += k
            done += k
            while k:
                take = min(incs[i].size - at, k)
                g.spans.append((incs[i], at, take))
                at += take
                k -= take
                if at == incs[i].size:
                    i, at = i + 1, 0
    d.groups = [g for g in groups if g.bytes]


def _read_direct(
    engine: _Engine,
    d: _Direct,
    spin: bool = False,
    abandon: Callable[[list[int]], None] | None = None,
) -> int:
    """Blocking: every submission at once, then awaited in order, each hashed by this thread
    as soon as it has landed while the engine reads the next ones (one core hashes ~10 GB/s,
    more than the TCP engine moves here; measured faster than handing pieces to the verify
    threads). `spin` on the event loop (`_read_all`, one-segment submissions only; reads still
    running after `LOOP_WAIT_S` go to `abandon` and the answer is `READ_ABANDONED`). Returns 0
    or the engine's failure status, only once the engine no longer writes into the slots."""
    te = engine.te
    groups = d.groups
    if len(groups) == 1 and not spin:
        g = groups[0]
        rc = int(te.batch_transfer_sync_read(d.session, g.local, g.remote, g.length))
        if rc == 0:
            _hash_spans(g.spans)
        return rc
    return _read_all(
        te,
        d.session,
        [(g.local, g.remote, g.length) for g in groups],
        lambda i: _hash_spans(groups[i].spans),
        spin,
        abandon=abandon,
    )


def _read_all(
    te: Any,
    session: str,
    submissions: Sequence[tuple[list[int], list[int], list[int]]],
    landed: Callable[[int], object],
    spin: bool,
    reading: Callable[[], object] | None = None,
    abandon: Callable[[list[int]], None] | None = None,
) -> int:
    """Submit every read (local addresses, remote addresses, lengths) at once, then await them
    in order, calling `landed(i)` as soon as submission i has landed, while the engine reads the
    next ones; `reading()` is called once all are submitted, before the first wait. Returns 0 or
    the engine's failure status, only once the engine no longer writes into any of the
    submissions' memory.

    With `spin` (reads on the event loop, which waits anyway; one-segment submissions only)
    each is awaited by polling (`_await_read`); reads still running `LOOP_WAIT_S` after the
    first wait are handed to `abandon` (their batch ids: the engine may still write into their
    memory) and the answer is `READ_ABANDONED`. Without it, by the engine's blocking wait."""
    assert not spin or (abandon is not None and all(len(s[0]) == 1 for s in submissions))
    submitted: list[int] = []
    rc = 0
    for local, remote, length in submissions:
        batch_id = int(te.batch_transfer_async_read(session, local, remote, length))
        if not _submitted(batch_id):
            rc = -1
            break
        submitted.append(batch_id)
    if rc == 0 and reading is not None:
        reading()
    now = time.perf_counter()
    spin_until, give_up_at = now + SPIN_WAIT_S, now + LOOP_WAIT_S
    for i, batch_id in enumerate(submitted):
        if spin:
            waited = _await_read(te, batch_id, spin_until, give_up_at)
            if waited is None:
                assert abandon is not None
                abandon(submitted[i:])
                return READ_ABANDONED
            status = waited
        else:
            status = int(te.get_batch_transfer_status([batch_id]))
        if status != 0:
            rc = rc or status
        elif rc == 0:
            landed(i)
    return rc


def _submitted(batch_id: int) -> bool:
    """Whether an engine submission was taken: the engine answers 0 for a failed submission
    and (uint64) -1 for a peer whose segment it could not open."""
    return 0 < batch_id < (1 << 64) - 1


def _await_read(te: Any, batch_id: int, spin_until: float, give_up_at: float) -> int | None:
    """Wait for a one-segment submission: 0 once it has completed, else the engine's failure
    status. Polls `transfer_check_status` (which frees the batch once it completed or failed,
    and looks at the batch's first segment only) without pause until `spin_until`, then with
    `POLL_SLEEP_S` sleeps until `give_up_at` (`time.perf_counter`): None if it is still
    running then (not freed: the engine may still write into its memory)."""
    check = te.transfer_check_status
    while True:
        status = int(check(batch_id))
        if status == 1:
            return 0
        if status == -1:
            return -1
        if status != 0:  # -2: the engine's own timeout; the batch is not freed then
            rc = int(te.get_batch_transfer_status([batch_id]))
            return rc or status
        now = time.perf_counter()
        if now > spin_until:
            if now > give_up_at:
                return None
            time.sleep(POLL_SLEEP_S)


def _settle_later(engine: _Engine, batch_ids: list[int], release: Callable[[], None]) -> None:
    """Reads given up on the event loop (`LOOP_WAIT_S`): a thread waits until the engine has
    finished with each (its own timeout bounds that), then `release` runs on the loop and
    their memory can be reused."""
    loop = asyncio.get_running_loop()
    te = engine.te

    def wait() -> None:
        for batch_id in batch_ids:
            # only waiting for the engine to let go: the fetch already failed with its own
            # error, and a failed status read means the batch is finished with too
            with contextlib.suppress(Exception):
                te.get_batch_transfer_status([batch_id])
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to give back
            loop.call_soon_threadsafe(release)

    engine.settle_pool.submit(wait)


def _hash_spans(spans: Sequence[tuple[_Incoming, int, int]]) -> None:
    for inc, pos, n in spans:
        inc.hasher.update(memoryview(inc.data)[pos : pos + n])


def _fetch_one(
    store: ArtifactStore,
    cat: _Catalog,
    engine: _Engine,
    key: str,
    entry: tuple[str, int, int, bytes],
) -> FetchResult | None:
    """The common small fetch, `_fetch_direct` for one listed artifact of at most
    `ONE_READ_BYTES` with less around it, on the loop into a reserved slot: up to
    `INLINE_PIECE` one engine read hashed in one call, above it pieces hashed as they land
    (`_read_all`). The fetch's result when stored; None leaves the key to the control path
    (no slot free, a failed or given-up read, which drops the catalog, or a stale entry,
    which is forgotten).

    Only the slot is taken before the read is submitted; the rest of the Python (the store's
    bookkeeping, the result) runs while the engine reads, so on the lent 16-core host it
    costs no time against a 47-62 us fetch of 4-64 KiB. A key the store does not hold yet is
    committed then, and deleted again if the read or its checksum fails. Nothing can see it
    in between: this runs on the event loop from submission to verdict without yielding, and
    the catalog pushes that tell peers about the slot go out only after it
    (`TransportServer._changed` defers them to the next loop turn, by then final)."""
    session, remote, size, digest = entry
    slot = store.reserve(size)
    if slot is None:
        return None
    arena = store.arena
    assert arena is not None
    local = engine.register_arena(arena) + slot
    if size > INLINE_PIECE:
        rc, ok, committed = _read_pieces(store, engine, key, entry, slot, local)
        done = FetchResult((key,), (), size, 1)
    else:  # no closure and no helper call before the submission: the 4-64 KiB hot path
        te = engine.te
        committed = False
        batch_id = int(te.batch_transfer_async_read(session, [local], [remote], [size]))
        if not _submitted(batch_id):
            rc, ok = -1, False
        else:  # from here to the poll, the engine reads meanwhile
            if not store.has(key):
                store.commit(key, slot, size, digest)
                committed = True
            done = FetchResult((key,), (), size, 1)
            view = arena.view[slot : slot + size]
            now = time.perf_counter()
            waited = _await_read(te, batch_id, now + SPIN_WAIT_S, now + LOOP_WAIT_S)
            if waited is None:
                _abandon_slot(store, engine, key, slot, committed, [batch_id])
                rc = READ_ABANDONED
            else:
                rc = waited
            ok = rc == 0 and checksum(view) == digest
    if ok:
        if not committed:
            store.commit(key, slot, size, digest)
        return done
    _fetch_one_failed(store, cat, key, slot, committed, rc)
    return None


def _read_pieces(
    store: ArtifactStore,
    engine: _Engine,
    key: str,
    entry: tuple[str, int, int, bytes],
    slot: int,
    local: int,
) -> tuple[int, bool, bool]:
    """`_fetch_one`'s read above `INLINE_PIECE`: pieces submitted at once, each hashed as it
    lands. Returns `_read_all`'s status, whether the bytes matched their checksum, and whether
    the key was committed meanwhile."""
    session, remote, size, digest = entry
    arena = store.arena
    assert arena is not None
    hasher = new_hasher()
    starts = range(0, size, INLINE_PIECE)
    view = arena.view[slot : slot + size]
    committed = False

    def reading() -> None:
        nonlocal committed
        if not store.has(key):
            store.commit(key, slot, size, digest)
            committed = True

    rc = _read_all(
        engine.te,
        session,
        [([local + o], [remote + o], [min(INLINE_PIECE, size - o)]) for o in starts],
        lambda i: hasher.update(view[starts[i] : starts[i] + INLINE_PIECE]),
        True,
        reading,
        lambda batch_ids: _abandon_slot(store, engine, key, slot, committed, batch_ids),
    )
    return rc, rc == 0 and hasher.digest() == digest, committed


def _abandon_slot(
    store: ArtifactStore,
    engine: _Engine,
    key: str,
    slot: int,
    committed: bool,
    batch_ids: list[int],
) -> None:
    """A one-call fetch's read was given up on the loop: the engine may still write into the
    slot, so it stays reserved until the engine lets go (an early commit is undone now)."""
    if committed:
        store.uncommit(key)
    _settle_later(engine, batch_ids, lambda: store.release(slot))


def _fetch_one_failed(
    store: ArtifactStore, cat: _Catalog, key: str, slot: int, committed: bool, rc: int
) -> None:
    """Undo a one-call fetch that failed (`rc`: 0 when the bytes failed their checksum, the
    engine's status, or `READ_ABANDONED`) and leave the key to the control path: a stale
    catalog entry is forgotten, a failed or given-up read drops the whole catalog."""
    if rc == READ_ABANDONED:
        cat.drop()  # the slot goes back once the engine lets go of it (`_abandon_slot`)
        return
    if committed:
        store.delete(key)  # frees the slot
    else:
        store.release(slot)
    if rc == 0:
        cat.entries.pop(key, None)
    else:
        cat.drop()


async def _fetch_direct(
    store: ArtifactStore, cat: _Catalog, keys: list[str], timeout_s: float
) -> tuple[list[str], list[str], int]:
    """Read the keys the peer's catalog lists one-sided into this store's arena: (keys stored,
    keys left to the control path, bytes stored). Keys whose catalog entry was stale (bytes
    failing their checksum: the peer has evicted or replaced them) are left to the control
    path too, as are all of them when an engine read fails."""
    assert store.arena is not None
    engine = _ENGINE
    assert engine is not None
    base = engine.register_arena(store.arena)
    by_session: dict[str, _Direct] = {}
    left: list[str] = []
    for key in keys:
        entry = cat.entries.get(key)
        slot = store.reserve(entry[2]) if entry is not None else None
        if entry is None or slot is None:
            left.append(key)
            continue
        session, remote, size, digest = entry
        inc = _Incoming(key, size, digest, store.slot_view(slot, size), base + slot, slot=slot)
        d = by_session.setdefault(session, _Direct(session, [], []))
        d.items.append(inc)
        d.remote.append(remote)
    fetched: list[str] = []
    nbytes = 0
    for d in by_session.values():
        total = sum(inc.size for inc in d.items)
        for _ in range(3):  # a busy loop may not have read the source's last heartbeat yet
            if total > INLINE_READ_BYTES or cat.fresh():
                break
            await asyncio.sleep(0)
        inline = total <= INLINE_READ_BYTES and cat.fresh()
        if inline:
            _plan_direct(d, INLINE_PIECE)
            inline = all(len(g.local) == 1 for g in d.groups)  # else scattered: a thread
        if inline:

            def abandon(batch_ids: list[int], d: _Direct = d) -> None:
                def give_back() -> None:
                    for inc in d.items:
                        store.release(inc.addr - base)

                _settle_later(engine, batch_ids, give_back)

            rc = _read_direct(engine, d, True, abandon)
            if rc == READ_ABANDONED:  # the slots go back once the engine lets go of them
                left.extend(inc.key for inc in d.items)
                cat.drop()
                continue
        else:
            _plan_direct(d, READ_CHUNK)
            job = engine.read_pool.submit(_read_direct, engine, d)
            try:
                async with asyncio.timeout(timeout_s):
                    rc = await asyncio.shield(asyncio.wrap_future(job))
            except BaseException as exc:  # timed out or cancelled: the read may still run
                loop = asyncio.get_running_loop()

                def release(
                    _: object, d: _Direct = d, loop: asyncio.AbstractEventLoop = loop
                ) -> None:
                    for inc in d.items:
                        with contextlib.suppress(RuntimeError):
                            loop.call_soon_threadsafe(store.release, inc.addr - base)

                job.add_done_callback(release)
                cat.drop()
                if isinstance(exc, TimeoutError):
                    raise TransferError(
                        f"engine read from {d.session} timed out after {timeout_s} s"
                    ) from exc
                raise
        for inc in d.items:
            if rc == 0 and inc.hasher.digest() == inc.expected:
                store.commit(inc.key, inc.addr - base, inc.size, inc.expected)
                fetched.append(inc.key)
                nbytes += inc.size
            else:
                store.release(inc.addr - base)
                if rc == 0:
                    cat.entries.pop(inc.key, None)  # stale: the control path knows better
                left.append(inc.key)
        if rc != 0:
            cat.drop()
    return fetched, left, nbytes


async def fetch(
    store: ArtifactStore,
    host: str,
    port: int,
    keys: Sequence[str],
    *,
    timeout_s: float = 30.0,
    settings: MooncakeSettings | None = None,
) -> FetchResult:
    """Pull `keys` from the peer sidecar whose control server is at host:port into `store`.
    Raises `TransferError` when the peer is unreachable, dies or times out mid-transfer, an
    engine read fails, or bytes fail their checksum; artifacts verified before that stay stored,
    nothing partial or unverified is. Control connections are reused between fetches."""
    if not AVAILABLE:
        raise TransferError(f"Mooncake Transfer Engine is unavailable: {UNAVAILABLE_REASON}")
    fetched: list[str] = []
    nbytes = 0
    if store.arena is not None:
        cat = _catalog(host, port)
        if len(keys) == 1 and _ENGINE is not None:
            key = keys[0]
            entry = cat.entries.get(key)
            if (
                entry is not None
                and entry[2] <= ONE_READ_BYTES
                and time.monotonic() - cat.heard_s < CATALOG_FRESH_S  # `cat.fresh()`, inline
            ):
                done = _fetch_one(store, cat, _ENGINE, key, entry)
                if done is not None:
                    return done
                return await _fetch_control(store, host, port, [key], timeout_s, settings)
        keys = list(keys)
        if cat.entries and _ENGINE is not None:
            fetched, keys, nbytes = await _fetch_direct(store, cat, keys, timeout_s)
            if not keys:
                return FetchResult(tuple(fetched), (), nbytes, len(fetched))
    res = await _fetch_control(store, host, port, list(keys), timeout_s, settings)
    if not fetched:
        return res
    return FetchResult((*fetched, *res.fetched), res.missing, nbytes + res.bytes, len(fetched))


async def _fetch_control(
    store: ArtifactStore,
    host: str,
    port: int,
    keys: list[str],
    timeout_s: float,
    settings: MooncakeSettings | None,
) -> FetchResult:
    conn = _take_idle(host, port)
    if conn is not None:
        try:
            return await _fetch_on(conn, store, host, port, keys, timeout_s, settings, True)
        except _StaleConnection:
            pass  # closed while idle (peer restarted): once more on a fresh connection
    try:
        async with asyncio.timeout(timeout_s):
            conn = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        raise TransferError(f"cannot reach sidecar {host}:{port}: {e}") from e
    return await _fetch_on(conn, store, host, port, keys, timeout_s, settings, False)


async def _fetch_on(
    conn: _Conn,
    store: ArtifactStore,
    host: str,
    port: int,
    keys: list[str],
    timeout_s: float,
    settings: MooncakeSettings | None,
    pooled: bool,
) -> FetchResult:
    reader, writer = conn
    receiving = _Receiving(store, keys)
    answered = False  # whether the peer has said anything on this connection yet
    try:
        sockname = writer.get_extra_info("sockname")
        hint = str(sockname[0]) if sockname else "127.0.0.1"
        receiving.engine = _ENGINE or await asyncio.to_thread(_engine, settings, hint)
        writer.write(_frame({"keys": keys}))
        await writer.drain()
        while True:
            async with asyncio.timeout(timeout_s):
                frame = await _read_frame(reader)
            answered = True
            batch = _Batch.parse(frame, len(keys))
            await receiving.read(batch, timeout_s)
            writer.write(_frame({"ack": batch.number}))
            await writer.drain()
            receiving.verify(batch)
            if batch.last:
                break
        receiving.check_complete()
        receiving.settle(block=True)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        writer.close()
        if pooled and not answered:
            raise _StaleConnection from e
        receiving.fail()
        if isinstance(e, asyncio.IncompleteReadError):
            raise TransferError(
                f"sidecar {host}:{port} closed mid-transfer "
                f"({len(receiving.fetched)}/{len(keys)} artifacts)"
            ) from e
        raise TransferError(f"fetch from {host}:{port} failed: {e!r}") from e
    except (TimeoutError, ValueError) as e:
        writer.close()
        receiving.fail()
        raise TransferError(f"fetch from {host}:{port} failed: {e!r}") from e
    except BaseException:
        writer.close()
        receiving.fail()
        raise
    _give_back(host, port, conn)
    return FetchResult(tuple(receiving.fetched), tuple(receiving.missing), receiving.bytes)


class _Receiving:
    """The destination's state of one fetch."""

    def __init__(self, store: ArtifactStore, keys: list[str]) -> None:
        self.store = store
        self.keys = keys
        self.engine: _Engine | None = None
        self.incoming: dict[int, _Incoming] = {}
        self.complete: deque[_Incoming] = deque()  # fully read, checksum job submitted
        self.fetched: list[str] = []
        self.missing: list[str] = []
        self.bytes = 0
        self.reading: concurrent.futures.Future[int] | None = None

    async def read(self, batch: _Batch, timeout_s: float) -> None:
        """Announce the batch's new artifacts and read its parts with the engine."""
        engine = self.engine
        assert engine is not None
        self.missing.extend(self.keys[i] for i in batch.missing)
        largest = max(self.store.memory_capacity_bytes, self.store.ssd_capacity_bytes)
        for i, size, digest in batch.new:
            if i in self.incoming:
                raise TransferError(f"peer announced {self.keys[i]!r} twice")
            if size > largest:
                raise TransferError(
                    f"{self.keys[i]!r}: {size} bytes exceed every tier of this store"
                )
            slot = self.store.reserve(size)
            if slot is not None:  # straight into this store's arena (registered once)
                assert self.store.arena is not None
                base = engine.register_arena(self.store.arena)
                view = self.store.slot_view(slot, size)
                inc = _Incoming(self.keys[i], size, digest, view, base + slot, slot=slot)
                inc.direct = size >= DIRECT_MIN
            else:
                data = _uninitialized_bytes(size)
                inc = _Incoming(self.keys[i], size, digest, data, _address_of(data))
                if size >= DIRECT_MIN:
                    engine.register(inc.addr, size)
                    inc.direct = inc.registered = True
            self.incoming[i] = inc
        plan = _ReadPlan(batch.session, [], [])
        for i, pos, n, remote in batch.parts:
            got = self.incoming.get(i)
            if got is None or pos != got.received or pos + n > got.size:
                raise TransferError(f"bad batch frame: part of key #{i} at {pos}")
            (plan.direct if got.direct else plan.small).append((got, pos, n, remote))
            got.received += n
        if plan.small:  # staged back to back by the source: one read of their span
            lo = min(remote for *_, remote in plan.small)
            hi = max(remote + n for _, _, n, remote in plan.small)
            if hi - lo > MAX_SMALL_SPAN:
                raise TransferError("bad batch frame: small parts spread too far apart")
            plan.recv = engine.take_receive_buffer(hi - lo)
            plan.lo, plan.span = lo, hi - lo
        if not batch.parts:
            return
        job = engine.read_pool.submit(_read_batch, engine, plan)
        self.reading = job
        try:
            async with asyncio.timeout(timeout_s):  # no task per await, unlike wait_for
                rc = await asyncio.shield(asyncio.wrap_future(job))
        except TimeoutError as e:
            raise TransferError(
                f"engine read from {batch.session} timed out after {timeout_s} s"
            ) from e
        if rc != 0:
            raise TransferError(
                f"engine read from {batch.session} failed ({rc}): the source died mid-transfer?"
            )
        self.reading = None

    def verify(self, batch: _Batch) -> None:
        """Queue the artifacts this batch completed (their hashing is already queued or done)
        and store those whose checksums are done."""
        engine = self.engine
        assert engine is not None
        done = {i for i, *_ in batch.parts} | {i for i, size, _ in batch.new if size == 0}
        for i in sorted(done):
            inc = self.incoming[i]
            if inc.received == inc.size:
                if inc.registered:
                    engine.unregister(inc.addr)
                    inc.registered = False
                self.complete.append(inc)
        self.settle(block=False)

    def settle(self, *, block: bool) -> None:
        """Store the completely read artifacts whose checksum jobs are done, in arrival order;
        `TransferError` at the first that does not match."""
        while self.complete:
            inc = self.complete[0]
            if inc.hashed is not None and not block and not inc.hashed.done():
                return
            self.complete.popleft()
            if inc.hashed is not None:
                inc.hashed.result()
            if inc.hasher.digest() != inc.expected:
                if inc.slot is not None:
                    self.store.release(inc.slot)
                    inc.slot = None
                raise TransferError(f"payload of {inc.key!r} does not match its checksum")
            if inc.slot is not None:
                self.store.commit(inc.key, inc.slot, inc.size, inc.expected)
                inc.slot = None
            else:
                data = inc.data
                assert isinstance(data, bytes)
                self.store.put(inc.key, data, expected_checksum=inc.expected, already_verified=True)
            self.fetched.append(inc.key)
            self.bytes += inc.size

    def check_complete(self) -> None:
        """After the last batch: every key was answered and every announced artifact arrived."""
        short = [inc.key for inc in self.incoming.values() if inc.received < inc.size]
        if short or len(self.incoming) + len(self.missing) != len(self.keys):
            raise TransferError(
                f"peer ended the transfer early ({len(short)} artifacts incomplete, "
                f"{len(self.keys) - len(self.incoming) - len(self.missing)} keys unanswered)"
            )

    def fail(self) -> None:
        """After an error: keep what arrived whole and verified, unregister the rest's buffers
        once no engine read writes into them any more."""
        while self.complete:  # each pass stores or drops at least one artifact
            with contextlib.suppress(Exception):  # the fetch is failing with its own error
                self.settle(block=True)
        engine = self.engine
        if engine is None:
            return
        leftovers = [inc for inc in self.incoming.values() if inc.registered]
        slots = [inc.slot for inc in self.incoming.values() if inc.slot is not None]
        store = self.store

        def unregister(_: object = None) -> None:
            for inc in leftovers:
                engine.unregister(inc.addr)
            for slot in slots:  # on the loop's thread: the store is not thread-safe
                with contextlib.suppress(RuntimeError):  # the loop is gone, and the store too
                    loop.call_soon_threadsafe(store.release, slot)

        loop = asyncio.get_running_loop()
        if self.reading is None or self.reading.done():
            unregister()
        else:
            self.reading.add_done_callback(unregister)
