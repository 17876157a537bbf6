"""A typed client of Mooncake Store (`mooncake.store.MooncakeDistributedStore`, the distributed
KV store of the Mooncake paper, FAST'25, used by vLLM's Mooncake store connector, SGLang HiCache
and LMCache): setup against a master, registered buffers, batch puts from and gets into
registered memory, remove, exists; every object carries its checksum and is verified on load.

**Object layout.** An artifact of n bytes is stored as one object of n + 16 bytes: the payload,
then its digest: the XXH3-128 of the payload (the sidecar's artifact checksum,
`workers.sidecar.store.checksum`) from the CPU writers here, or the keyed MAC the connector's
GPU path computes on the device (`workers.mooncake_store.digest`: the digest says its kind).
A reader needs nothing but the key: `get_into` reads the object into a slot, verifies the
payload in place against the trailer (`digest.verify`, either kind). A writer leaves 16
writable bytes after each payload in its buffer (`put_from` writes the digest there), so a save
is gather, hash, one batch put, with no Python `bytes` per artifact. Payloads packed back to
back (a staging buffer's) go with their digests in a separate registered slot each
(`put_split`, `get_split`: the store's multi-buffer batch calls; the object's bytes are the
same); objects framed by the caller, digest included, go as they are (`put_objects`).

**Errors.** The binding answers status integers (Mooncake's `ErrorCode`,
`mooncake-store/include/types.h`); here the master out of reach (`RPC_FAIL`, `RPC_TIMEOUT`) is
`StoreUnavailable` for the whole call. A key the store does not hold (`OBJECT_NOT_FOUND`), a
replica not readable (`REPLICA_IS_NOT_READY`), one whose read outlasted its lease
(`LEASE_EXPIRED`: the master may have evicted it meanwhile, so the bytes are not trusted) or
one whose segment's process is gone (`TRANSFER_FAIL`) reads as `MISSING`; a payload that fails
its digest as `CORRUPTED`.

**Replica cache** (`ClientSettings.replica_cache_s`, off by default; the sidecar's store tier
and the connector turn it on): a key read twice within it gets a get session
(`batch_get_session_start`: the master's replica lookup once, and a lease), and its next reads
are ranged gets through the cached replica, with no master round trip. A cached replica may go
stale (the object force-removed and its memory reused by another object, a master restarted):
measured, such a read returns the other object's bytes with that object's valid digest, so each
cached read must also match the digest first read for the key (keys name their bytes), else the
key is read afresh through the master.

**Direct reads** (`ClientSettings.direct_reads`; the sidecar's store tier turns it on): a
batch get of several keys asks the master for their replicas' addresses in one call, then reads
them through a Transfer Engine of this process on the master's metadata server (the store's
segments are registered there under their names): objects of at most `COALESCE_MAX_BYTES`
lying at most `COALESCE_GAP_BYTES` apart in one segment (a batch put lands its objects one
size class apart) go as one transfer into a registered scratch area and are copied to their
slots, larger ones straight into their slots. The store's own `batch_get_into` moves each object
on its own (~0.1 ms apiece on loopback TCP whatever its size: 256 x 4 KiB took 30 ms against
0.6-2 ms for one read of the same bytes). Every object read so is verified as any other; a
replica not found, a transfer that fails (its segment gone) or an object not fitting its slot
is read again through the store's own call, which says why. Batches of larger objects (slots
of more than `COALESCE_MAX_BYTES` on average) keep the store's gets: their lookup is a small
part of them, and read again, the store's ranged reads through get sessions measured faster
than the engine's batch read (1.56x against 1.17x a raw read, 16 x 1 MiB; 64 x 64 KiB
0.65-1.27x against 0.42-0.81x, the copies out of the scratch area included). A single key
keeps the store's own get (one lookup either way) and, read again, the replica cache. A batch
read directly skips the get sessions: with the replica cache on, the places of its replicas
read within `replica_cache_s` are kept, so a batch read again needs no lookup at all, each
object checked against the digest first read there (keys name their bytes: one that moved is
read afresh through the store).

**Zero-copy access** (the connector's GPU path, `workers.vllm_connector.store_path`): the
replicas of objects in this client's own segment are memory of this process
(`local_replicas`: the master's replica descriptors, an address each); objects reserved there
(`reserve_local`: a put session started and ended, the object then all zeros until the caller
writes it) are written in place by the caller. An all-zero object fails every digest, so
nothing reads a reserved object as valid before it is written.

Calls block (a master round trip, then the transfer); the caller runs them off its event loop
(`workers.sidecar.store_tier`). Measured on loopback TCP (2-core VM): a get ~0.3 ms + transfer;
with the master killed, a get fails in ~4 ms, `is_exist` and puts in ~4.3 s (the client's own
reconnect), and a master restarted on the same ports serves the clients again (their segments
re-mounted, the objects of before gone).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ownerserve.ports import free_port
from workers.mooncake_store.digest import DIGEST_BYTES, checksum, verify
from workers.mooncake_store.master import MasterAddress, master_answers

log = logging.getLogger(__name__)

CHECKSUM_BYTES = DIGEST_BYTES
"""Bytes of the digest stored after every payload (`workers.mooncake_store.digest`)."""
PARALLEL_DIGEST_BYTES = 4 << 20
"""Below this many payload bytes a batch is hashed on the calling thread."""
COALESCE_MAX_BYTES = 32 << 10
"""Objects up to this size are read together with their neighbours (`direct_reads`)."""
COALESCE_GAP_BYTES = 16 << 10
"""The most bytes between two objects read in one transfer (read and thrown away)."""
RUN_BYTES = 1 << 20
"""The most bytes one transfer of neighbours spans: a batch's runs go in one engine call, which
moves them side by side (one run of 4.7 MB, 64 x 64 KiB, read slower than the store's
per-object reads)."""
SCRATCH_BYTES = 8 << 20
"""The registered scratch area coalesced reads land in (one batch's runs at a time)."""
REPLICA_CACHE_KEYS = 1 << 16
"""Most keys whose replicas one client keeps cached (the oldest go first)."""

# Mooncake's ErrorCode values (mooncake-store/include/types.h)
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

MISSING = -1
"""`get_into`'s answer for a key that is not readable (absent, evicted, its segment gone)."""
CORRUPTED = -2
"""`get_into`'s answer for an object whose payload fails its digest (or is shorter than one)."""

_UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
_UNREADABLE = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, LEASE_EXPIRED, TRANSFER_FAIL})


class StoreError(Exception):
    """Base of the Mooncake Store client's errors."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (setup failed, the master is down, a call timed out)."""


class StoreFull(StoreError):
    """The store has no room for an object (every segment full)."""


EXISTS = -3
"""`reserve_local`'s answer for a key the store holds already (an artifact's key names its
bytes: nothing to write)."""


@dataclass(frozen=True, slots=True)
class Replica:
    """An object's bytes in this client's own segment: `size` bytes at `address`, an address
    in this process."""

    address: int
    size: int


def memory_at(address: int, size: int) -> memoryview:
    """A writable view of `size` bytes at `address` (memory the caller owns)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """One client's `setup`: the master, this client's address and the memory it gives."""

    master: MasterAddress
    local_host: str = "127.0.0.1"
    """The host peers reach this client's segment at (the engine picks the port)."""
    segment_bytes: int = 256 << 20
    """Memory this client mounts into the store (objects put anywhere may land in it); 0: none."""
    local_buffer_bytes: int = 16 << 20
    """The client's own transfer buffer (for puts and gets from unregistered memory)."""
    protocol: str = "tcp"
    rdma_devices: str = ""
    digest_threads: int = 1
    """Threads that hash a split batch's payloads (`put_split`, `get_split`; xxhash releases
    the GIL): a 128 MiB load is ~5-40 ms of hashing on one core."""
    replica_cache_s: float = 0.0
    """How long a replica stays cached once its object is read twice within this time (a get
    session: the next reads of it skip the master's lookup); 0: off. Each cached read is checked
    against the digest first read for the key, so a replica that moved meanwhile is read afresh,
    never served."""
    direct_reads: bool = False
    """Batch gets look the replicas up (`batch_get_replica_desc`) and read them where they lie
    through this client's own Transfer Engine, small objects lying near each other in one
    transfer (`DirectReads`), instead of the store's one transfer per object."""


class RegisteredBuffer:
    """Page-aligned anonymous memory registered with a client (registered memory is what the
    store's transfers read from and write into without a copy); `close` unregisters it."""

    def __init__(self, client: StoreClient, size: int) -> None:
        if size <= 0:
            raise ValueError("a registered buffer needs at least one byte")
        self.size = size
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._client = client
        client.register(self.address, size)

    def close(self) -> None:
        if self._client is not None:
            self._client.unregister(self.address)
            self._client = None  # type: ignore[assignment]
        self.view.release()
        self._map.close()


@dataclass(frozen=True, slots=True)
class Location:
    """Where an object's complete memory replica lies: `size` bytes (payload and digest) at
    `address` in the segment named `segment`."""

    segment: str
    address: int
    size: int


class DirectReads:
    """A Transfer Engine of this process on the master's metadata server, which reads the
    store's replicas where they lie (`ClientSettings.direct_reads`)."""

    def __init__(self, metadata_url: str, host: str) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        # a name of its own on the metadata server (without a port, every reader on one host
        # would claim the same name there, and all but the first fail to start)
        self.name = f"{host}:{free_port()}"
        rc = self.te.initialize(self.name, metadata_url, "tcp", "")
        if rc != 0:
            raise StoreUnavailable(f"Transfer Engine initialize on {metadata_url} failed: {rc}")
        self._scratch = mmap.mmap(-1, SCRATCH_BYTES)
        self.scratch = ctypes.addressof(ctypes.c_char.from_buffer(self._scratch))
        self.register(self.scratch, SCRATCH_BYTES)
        self.lock = threading.Lock()
        """Held while the scratch area is in use."""

    def register(self, address: int, size: int) -> None:
        rc = self.te.register_memory(address, size, "cpu:0")
        if rc != 0:
            raise StoreError(f"Transfer Engine register_memory({size} bytes) failed: {rc}")

    def unregister(self, address: int) -> None:
        self.te.unregister_memory(address)

    def read(
        self, segment: str, locals_: Sequence[int], remotes: Sequence[int], sizes: Sequence[int]
    ) -> bool:
        """Read each range of `segment` into registered memory here, in one batch."""
        if len(remotes) == 1:
            rc = self.te.transfer_sync_read(segment, locals_[0], remotes[0], sizes[0])
        else:
            rc = self.te.batch_transfer_sync_read(
                segment, list(locals_), list(remotes), list(sizes)
            )
        return int(rc) == 0


def _runs(order: Sequence[tuple[int, Location]]) -> list[list[tuple[int, Location]]]:
    """Objects of one segment, by address, cut into runs read in one transfer each: small
    neighbours together (`COALESCE_*`), within `RUN_BYTES`; a large object alone."""
    runs: list[list[tuple[int, Location]]] = []
    for item in order:
        loc = item[1]
        last = runs[-1] if runs else None
        if (
            last is not None
            and loc.size <= COALESCE_MAX_BYTES
            and last[-1][1].size <= COALESCE_MAX_BYTES
            and 0 <= loc.address - (last[-1][1].address + last[-1][1].size) <= COALESCE_GAP_BYTES
            and loc.address + loc.size - last[0][1].address <= RUN_BYTES
        ):
            last.append(item)
        else:
            runs.append([item])
    return runs


class StoreClient:
    """One `MooncakeDistributedStore` set up against a master (`open`). Methods block; the
    answers per key keep the order of the keys asked for."""

    def __init__(self, store: Any, settings: ClientSettings) -> None:
        self._store = store
        self.settings = settings
        self.segment: str = store.get_hostname()
        """This client's segment name (host:port), what `put_from(local=True)` prefers."""
        self._closed = False
        self._cache_lock = threading.Lock()
        self._replicas: dict[str, tuple[float, int, bytes]] = {}
        self._seen: dict[str, float] = {}  # keys read once lately, when
        self._local: dict[str, tuple[float, Replica]] = {}  # `local_replicas(cached=True)`
        # direct batch reads: key -> (when, where its replica lay, the digest read there)
        self._located: dict[str, tuple[float, Location, bytes]] = {}
        self._digest_pool = (
            ThreadPoolExecutor(settings.digest_threads, thread_name_prefix="store-digest")
            if settings.digest_threads > 1
            else None
        )
        self.direct_objects = 0
        """Objects read where their replicas lie (`direct_reads`), since `open`."""
        self.direct_transfers = 0
        """The transfers they took (neighbours share one)."""
        self.direct_lookups = 0
        """The master calls that located them (none for a batch whose places were kept)."""
        self._direct: DirectReads | None = None
        if settings.direct_reads:
            try:
                self._direct = DirectReads(settings.master.metadata_url, settings.local_host)
            except StoreError as exc:  # the store's own gets still serve every read
                log.warning("Mooncake Store direct reads are off: %s", exc)

    def _digests(self, addresses: Sequence[int], sizes: Sequence[int]) -> list[bytes]:
        """The checksum of each payload, on the digest threads when they are worth it."""
        views = [memory_at(a, n) for a, n in zip(addresses, sizes, strict=True)]
        pool = self._digest_pool
        if pool is None or len(views) < 2 or sum(sizes) < PARALLEL_DIGEST_BYTES:
            return [checksum(v) for v in views]
        per = -(-len(views) // self.settings.digest_threads)
        return list(pool.map(checksum, views, chunksize=per))

    def _verified(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        digests: list[int],
    ) -> list[bool]:
        """Whether each payload verifies against the digest at `digests[i]` (`verify`, either
        kind), on the digest threads when they are worth it."""

        def one(i: int) -> bool:
            return verify(
                keys[i], memory_at(addresses[i], sizes[i]), memory_at(digests[i], CHECKSUM_BYTES)
            )

        pool = self._digest_pool
        if pool is None or len(keys) < 2 or sum(sizes) < PARALLEL_DIGEST_BYTES:
            return [one(i) for i in range(len(keys))]
        per = -(-len(keys) // self.settings.digest_threads)
        return list(pool.map(one, range(len(keys)), chunksize=per))

    @classmethod
    def open(cls, settings: ClientSettings) -> StoreClient:
        """Set up a client; `StoreUnavailable` when the module does not import or the master
        cannot be reached."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreUnavailable(f"mooncake.store does not import: {exc}") from exc
        # setup against a master that is not there retries for ~90 s before it gives up
        if not master_answers(settings.master):
            raise StoreUnavailable(
                f"no Mooncake master answers at {settings.master.rpc} "
                f"(metadata {settings.master.metadata_url})"
            )
        store = MooncakeDistributedStore()
        rc = store.setup(
            {
                "local_hostname": settings.local_host,
                "metadata_server": settings.master.metadata_url,
                "global_segment_size": settings.segment_bytes,
                "local_buffer_size": settings.local_buffer_bytes,
                "protocol": settings.protocol,
                "rdma_devices": settings.rdma_devices,
                "master_server_addr": settings.master.rpc,
            }
        )
        if rc != 0:
            raise StoreUnavailable(
                f"Mooncake Store setup against master {settings.master.rpc} "
                f"(metadata {settings.master.metadata_url}) failed with {rc}"
            )
        return cls(store, settings)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._digest_pool is not None:
                self._digest_pool.shutdown(wait=True)
            self._store.close()

    def _live(self) -> Any:
        if self._closed:
            raise StoreUnavailable("the Mooncake Store client is closed")
        return self._store

    # --- registered memory ----------------------------------------------------------------------

    def register(self, address: int, size: int) -> None:
        rc = self._live().register_buffer(address, size)
        if rc != 0:
            raise StoreError(f"register_buffer({size} bytes) failed with {rc}")
        if self._direct is not None:
            self._direct.register(address, size)

    def unregister(self, address: int) -> None:
        if not self._closed:
            self._store.unregister_buffer(address)
            if self._direct is not None:
                self._direct.unregister(address)

    def buffer(self, size: int) -> RegisteredBuffer:
        """A new registered buffer of `size` bytes."""
        return RegisteredBuffer(self, size)

    # --- objects --------------------------------------------------------------------------------

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        *,
        local: bool = True,
    ) -> list[int]:
        """Store each payload (`sizes[i]` bytes at `addresses[i]`, with `CHECKSUM_BYTES`
        writable bytes after it for the digest, written here) as one object; with `local`, in
        this client's own segment when it has room. Per key: 0 stored (or already there: an
        artifact's key names its bytes), else Mooncake's negative code. `StoreUnavailable`
        when the master cannot be reached, `StoreFull` when no key found room."""
        for address, size in zip(addresses, sizes, strict=True):
            ctypes.memmove(address + size, checksum(memory_at(address, size)), CHECKSUM_BYTES)
        store = self._live()
        framed = [size + CHECKSUM_BYTES for size in sizes]
        if local and self.settings.segment_bytes > 0:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.preferred_segment = self.segment
            codes = store.batch_put_from(list(keys), list(addresses), framed, config)
        else:
            codes = store.batch_put_from(list(keys), list(addresses), framed)
        return self._put_codes(codes)

    def put_split(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        digests: Sequence[int],
        *,
        local: bool = True,
    ) -> list[int]:
        """`put_from` for payloads packed back to back (a staging buffer's artifacts): each
        payload's digest is written to the `CHECKSUM_BYTES` of registered memory at
        `digests[i]` and the object is the payload then that digest (the same bytes
        `put_from` stores), in one batch call."""
        for digest, value in zip(digests, self._digests(addresses, sizes), strict=True):
            ctypes.memmove(digest, value, CHECKSUM_BYTES)
        store = self._live()
        parts = [[a, d] for a, d in zip(addresses, digests, strict=True)]
        lengths = [[size, CHECKSUM_BYTES] for size in sizes]
        if local and self.settings.segment_bytes > 0:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.preferred_segment = self.segment
            codes = store.batch_put_from_multi_buffers(list(keys), parts, lengths, config)
        else:
            codes = store.batch_put_from_multi_buffers(list(keys), parts, lengths)
        return self._put_codes(codes)

    def _put_codes(self, codes: Sequence[int]) -> list[int]:
        out = [0 if c == OBJECT_ALREADY_EXISTS else int(c) for c in codes]
        if any(c in _UNREACHABLE for c in out):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        if out and all(c == NO_AVAILABLE_HANDLE for c in out):
            raise StoreFull(f"Mooncake Store has no room for {len(out)} objects")
        return out

    def get_into(
        self, keys: Sequence[str], addresses: Sequence[int], capacities: Sequence[int]
    ) -> list[int]:
        """Read each object into `capacities[i]` bytes at `addresses[i]` (payload + digest must
        fit) and verify it there. Per key: the payload's size, `MISSING` or `CORRUPTED`.
        `StoreUnavailable` when the master cannot be reached."""
        store = self._live()
        out: list[int | None] = [None] * len(keys)
        # a batch read directly needs no cached replicas: one lookup for all of it
        batch = (
            self._direct is not None
            and len(keys) > 1
            and sum(capacities) <= COALESCE_MAX_BYTES * len(keys)
        )
        hot = {} if batch else self._hot(keys, lambda i, size: size <= capacities[i])
        if hot:
            got = store.batch_get_into_multi_buffer_ranges(
                [keys[i] for i in hot],
                [[addresses[i]] for i in hot],
                [[size] for _, size, _ in hot.values()],
                [[0] for _ in hot],
            )
            for (i, (_key, size, digest)), n in zip(hot.items(), got, strict=True):
                view = memory_at(addresses[i], size)
                payload = size - CHECKSUM_BYTES
                # the digest known for this key names its bytes: a replica that moved (removed,
                # evicted, a master restarted) reads as something else, and is read afresh
                if (
                    int(n) == size
                    and view[payload:] == digest
                    and verify(keys[i], view[:payload], digest)
                ):
                    out[i] = payload
        cold = [i for i, got_one in enumerate(out) if got_one is None]
        self._forget([keys[i] for i in cold if i in hot])
        if not cold:
            return [int(n) for n in out]  # type: ignore[arg-type]
        fresh: list[tuple[str, int, bytes]] = []
        if batch and self._direct is not None and len(cold) > 1:
            known = self._known_locations([keys[i] for i in cold])
            read, where = self._read_direct(self._direct, keys, addresses, capacities, cold, known)
            located: list[tuple[str, Location, bytes]] = []
            again: list[int] = []
            for i, n in read.items():
                view = memory_at(addresses[i], n)
                size = n - CHECKSUM_BYTES
                digest = bytes(view[size:])
                was = known.get(keys[i])
                if was is not None and was[1] != digest:
                    again.append(i)  # the replica moved since: read it afresh
                elif verify(keys[i], view[:size], digest):
                    out[i] = size
                    fresh.append((keys[i], n, digest))
                    located.append((keys[i], where[i], digest))
                else:
                    out[i] = CORRUPTED
            self._keep_locations(located, [keys[i] for i in again])
            afresh = set(again)
            cold = [i for i in cold if i not in read or i in afresh]
        codes = (
            store.batch_get_into(
                [keys[i] for i in cold],
                [addresses[i] for i in cold],
                [capacities[i] for i in cold],
            )
            if cold
            else []
        )
        for i, n in zip(cold, codes, strict=True):
            n = int(n)
            if n in _UNREACHABLE:
                raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
            if n < 0:
                if n in _UNREADABLE:
                    out[i] = MISSING
                    continue
                if n == INVALID_PARAMS:  # larger than the slot: not the artifact listed
                    out[i] = CORRUPTED
                    continue
                raise StoreError(f"get of {keys[i]!r} failed with {n}")
            size = n - CHECKSUM_BYTES
            if size < 0:
                out[i] = CORRUPTED
                continue
            view = memory_at(addresses[i], n)
            digest = bytes(view[size:])
            if verify(keys[i], view[:size], digest):
                out[i] = size
                fresh.append((keys[i], n, digest))
            else:
                out[i] = CORRUPTED
        if not batch:  # a batch read directly again looks its replicas up again, in one call
            self._remember(fresh)
        return [int(n) for n in out]  # type: ignore[arg-type]

    def locate(self, keys: Sequence[str]) -> list[Location | None]:
        """Each key's first complete memory replica (one master call), or None: no such object,
        or the master out of reach (the caller then reads through the store, which says so)."""
        from mooncake.store import ReplicaStatus

        try:
            descs = self._live().batch_get_replica_desc(list(keys))
        except RuntimeError:
            return [None] * len(keys)
        out: list[Location | None] = []
        for key in keys:
            found = None
            for r in descs.get(key, ()):
                if r.is_memory_replica() and r.status == ReplicaStatus.COMPLETE:
                    bd = r.get_memory_descriptor().buffer_descriptor
                    found = Location(bd.transport_endpoint, int(bd.buffer_address), int(bd.size))
                    break
            out.append(found)
        return out

    def _known_locations(self, keys: Sequence[str]) -> dict[str, tuple[Location, bytes]]:
        """The replicas of `keys` located and read within `replica_cache_s`, with the digest
        read there (a batch read again needs no lookup)."""
        ttl = self.settings.replica_cache_s
        if ttl <= 0:
            return {}
        now = time.monotonic()
        out: dict[str, tuple[Location, bytes]] = {}
        with self._cache_lock:
            for key in keys:
                hit = self._located.get(key)
                if hit is not None and now - hit[0] < ttl:
                    out[key] = (hit[1], hit[2])
        return out

    def _keep_locations(
        self, located: Sequence[tuple[str, Location, bytes]], stale: Sequence[str]
    ) -> None:
        ttl = self.settings.replica_cache_s
        if ttl <= 0:
            return
        now = time.monotonic()
        with self._cache_lock:
            for key in stale:
                self._located.pop(key, None)
            for key, loc, digest in located:
                self._located.pop(key, None)
                self._located[key] = (now, loc, digest)
            while len(self._located) > REPLICA_CACHE_KEYS:  # oldest first
                del self._located[next(iter(self._located))]

    def _read_direct(
        self,
        direct: DirectReads,
        keys: Sequence[str],
        addresses: Sequence[int],
        capacities: Sequence[int],
        which: Sequence[int],
        known: dict[str, tuple[Location, bytes]],
    ) -> tuple[dict[int, int], dict[int, Location]]:
        """Read the objects `which` (indexes) where their replicas lie into their slots
        (module docstring, *Direct reads*), unverified: index -> object bytes of those read,
        and where each was. Replicas in `known` are not looked up again. The rest (not found,
        too large for the slot, a transfer failed) are left out."""
        ask = [i for i in which if keys[i] not in known]
        found = dict(zip(ask, self.locate([keys[i] for i in ask]), strict=True)) if ask else {}
        self.direct_lookups += 1 if ask else 0
        where: dict[int, Location] = {}
        by_segment: dict[str, list[tuple[int, Location]]] = {}
        for i in which:
            hit = known.get(keys[i])
            loc = hit[0] if hit is not None else found.get(i)
            if loc is not None and CHECKSUM_BYTES <= loc.size <= capacities[i]:
                where[i] = loc
                by_segment.setdefault(loc.segment, []).append((i, loc))
        done: dict[int, int] = {}
        for segment, items in by_segment.items():
            items.sort(key=lambda item: item[1].address)
            alone: list[tuple[int, Location]] = []
            together: list[list[tuple[int, Location]]] = []
            for run in _runs(items):
                if len(run) == 1:
                    alone.append(run[0])
                else:
                    together.append(run)
            if alone and direct.read(
                segment,
                [addresses[i] for i, _ in alone],
                [loc.address for _, loc in alone],
                [loc.size for _, loc in alone],
            ):
                done.update((i, loc.size) for i, loc in alone)
                self.direct_objects += len(alone)
                self.direct_transfers += len(alone)
            if not together:
                continue
            with direct.lock:  # runs of one call share the scratch area, one after another
                batch: list[list[tuple[int, Location]]] = []
                used = 0
                for run in [*together, []]:
                    span = run[-1][1].address + run[-1][1].size - run[0][1].address if run else 0
                    if batch and (not run or used + span > SCRATCH_BYTES):
                        self._read_runs(direct, segment, batch, addresses, done)
                        batch, used = [], 0
                    if run:
                        batch.append(run)
                        used += span
        return done, where

    def _read_runs(
        self,
        direct: DirectReads,
        segment: str,
        runs: list[list[tuple[int, Location]]],
        addresses: Sequence[int],
        done: dict[int, int],
    ) -> None:
        """One transfer per run into the scratch area, then each object to its slot."""
        offsets, starts, spans, at = [], [], [], 0
        for run in runs:
            start = run[0][1].address
            span = run[-1][1].address + run[-1][1].size - start
            offsets.append(direct.scratch + at)
            starts.append(start)
            spans.append(span)
            at += span
        if not direct.read(segment, offsets, starts, spans):
            return
        self.direct_transfers += len(runs)
        for run, base, start in zip(runs, offsets, starts, strict=True):
            for i, loc in run:
                ctypes.memmove(addresses[i], base + loc.address - start, loc.size)
                done[i] = loc.size
                self.direct_objects += 1

    def get_split(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        digests: Sequence[int],
    ) -> list[int]:
        """Read each object of exactly `sizes[i]` payload bytes into `addresses[i]` and its
        digest into the `CHECKSUM_BYTES` at `digests[i]` (payloads land back to back in a
        staging buffer), in one batch call, and verify each in place. Per key: the payload's
        size, `MISSING` (also an object of another size: the store refuses to split it) or
        `CORRUPTED`. `StoreUnavailable` when the master cannot be reached."""
        store = self._live()
        out: list[int | None] = [None] * len(keys)
        hot = self._hot(keys, lambda i, size: size == sizes[i] + CHECKSUM_BYTES)
        if hot:
            got = store.batch_get_into_multi_buffer_ranges(
                [keys[i] for i in hot],
                [[addresses[i], digests[i]] for i in hot],
                [[sizes[i], CHECKSUM_BYTES] for i in hot],
                [[0, sizes[i]] for i in hot],
            )
            read = [
                i
                for i, n in zip(hot, got, strict=True)
                if int(n) == hot[i][1] and memory_at(digests[i], CHECKSUM_BYTES) == hot[i][2]
            ]
            good = self._verified(
                [keys[i] for i in read],
                [addresses[i] for i in read],
                [sizes[i] for i in read],
                [digests[i] for i in read],
            )
            for i, ok in zip(read, good, strict=True):
                if ok:
                    out[i] = sizes[i]
        cold = [i for i, got_one in enumerate(out) if got_one is None]
        self._forget([keys[i] for i in cold if i in hot])
        if not cold:
            return [int(n) for n in out]  # type: ignore[arg-type]
        codes = [
            int(n)
            for n in store.batch_get_into_multi_buffers(
                [keys[i] for i in cold],
                [[addresses[i], digests[i]] for i in cold],
                [[sizes[i], CHECKSUM_BYTES] for i in cold],
            )
        ]
        read = [i for i, n in zip(cold, codes, strict=True) if n == sizes[i] + CHECKSUM_BYTES]
        good = self._verified(
            [keys[i] for i in read],
            [addresses[i] for i in read],
            [sizes[i] for i in read],
            [digests[i] for i in read],
        )
        verified = dict(zip(read, good, strict=True))
        fresh: list[tuple[str, int, bytes]] = []
        for i, n in zip(cold, codes, strict=True):
            if n in _UNREACHABLE:
                raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
            if n < 0:
                # a larger object fails its transfer (TRANSFER_FAIL), a smaller one is
                # INVALID_PARAMS: neither is the artifact listed
                if n in _UNREADABLE or n == INVALID_PARAMS:
                    out[i] = MISSING if n in _UNREADABLE else CORRUPTED
                    continue
                raise StoreError(f"get of {keys[i]!r} failed with {n}")
            if n != sizes[i] + CHECKSUM_BYTES:
                out[i] = CORRUPTED
                continue
            digest = bytes(memory_at(digests[i], CHECKSUM_BYTES))
            if verified[i]:
                out[i] = sizes[i]
                fresh.append((keys[i], n, digest))
            else:
                out[i] = CORRUPTED
        self._remember(fresh)
        return [int(n) for n in out]  # type: ignore[arg-type]

    def put_objects(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        *,
        local: bool = True,
    ) -> list[int]:
        """Store objects already framed (`sizes[i]` bytes at `addresses[i]`: payload, then a
        digest the caller wrote, of either kind) as they are; codes as `put_from`."""
        store = self._live()
        if local and self.settings.segment_bytes > 0:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.preferred_segment = self.segment
            codes = store.batch_put_from(list(keys), list(addresses), list(sizes), config)
        else:
            codes = store.batch_put_from(list(keys), list(addresses), list(sizes))
        return self._put_codes(codes)

    # --- zero-copy access to this client's own segment ------------------------------------------

    def local_replicas(self, keys: Sequence[str], *, cached: bool = False) -> list[Replica | None]:
        """Each key's complete replica in this client's own segment, or None (no such object,
        not complete, or held in another segment only). With `cached`, a key looked up within
        `replica_cache_s` is answered from that lookup with no master round trip: the caller
        must verify what it reads there by a digest keyed to the object (a cached replica may
        have moved since), and `forget_local` the keys that failed."""
        out: list[Replica | None] = [None] * len(keys)
        ask: list[int] = []
        ttl = self.settings.replica_cache_s
        now = time.monotonic()
        if cached and ttl > 0:
            with self._cache_lock:
                for i, key in enumerate(keys):
                    hit = self._local.get(key)
                    if hit is not None and now - hit[0] < ttl:
                        out[i] = hit[1]
                    else:
                        ask.append(i)
        else:
            ask = list(range(len(keys)))
        if not ask:
            return out
        from mooncake.store import ReplicaStatus

        try:
            descs = self._live().batch_get_replica_desc([keys[i] for i in ask])
        except RuntimeError:  # the master out of reach: the caller reads through the store
            return out
        fresh: list[tuple[str, Replica]] = []
        for i in ask:
            for r in descs.get(keys[i], ()):
                if not r.is_memory_replica() or r.status != ReplicaStatus.COMPLETE:
                    continue
                bd = r.get_memory_descriptor().buffer_descriptor
                if bd.transport_endpoint == self.segment:
                    out[i] = Replica(int(bd.buffer_address), int(bd.size))
                    fresh.append((keys[i], out[i]))  # type: ignore[arg-type]
                    break
        if cached and ttl > 0 and fresh:
            with self._cache_lock:
                for key, replica in fresh:
                    self._local.pop(key, None)
                    self._local[key] = (now, replica)
                while len(self._local) > REPLICA_CACHE_KEYS:  # oldest first
                    del self._local[next(iter(self._local))]
        return out

    def forget_local(self, keys: Sequence[str]) -> None:
        """Drop cached `local_replicas` answers of `keys` (they failed their digest there)."""
        with self._cache_lock:
            for key in keys:
                self._local.pop(key, None)

    def reserve_local(
        self, keys: Sequence[str], size: int | Sequence[int]
    ) -> list[Replica | int | None]:
        """Objects of `size` bytes (one size, or one per key) allocated in this client's own
        segment for the caller to write in place (a put session started and ended: the object
        reads as zeros, which no digest accepts, until written). Per key: its `Replica`,
        `EXISTS` (the store holds the key: nothing to write), or None (not reserved here: the
        segment had no room, or the master placed it elsewhere and it was removed again; put
        it through the store).
        `StoreUnavailable` when the master cannot be reached."""
        from mooncake.store import ReplicateConfig

        if not keys:
            return []
        store = self._live()
        if self.settings.segment_bytes <= 0:
            return [None] * len(keys)
        sizes = [size] * len(keys) if isinstance(size, int) else [int(n) for n in size]
        if len(sizes) != len(keys):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys")
        config = ReplicateConfig()
        config.preferred_segment = self.segment
        codes = [int(c) for c in store.batch_put_session_start(list(keys), sizes, config)]
        if any(c in _UNREACHABLE for c in codes):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        out: list[Replica | int | None] = [
            EXISTS if c == OBJECT_ALREADY_EXISTS else None for c in codes
        ]
        started = [i for i, c in enumerate(codes) if c == 0]
        if not started:
            return out
        ends = [int(c) for c in store.batch_put_session_end([keys[i] for i in started])]
        if any(c in _UNREACHABLE for c in ends):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        failed = [keys[i] for i, c in zip(started, ends, strict=True) if c != 0]
        if failed:
            store.batch_put_session_revoke(failed)
        ended = [i for i, c in zip(started, ends, strict=True) if c == 0]
        found = self.local_replicas([keys[i] for i in ended])
        elsewhere: list[str] = []
        for i, replica in zip(ended, found, strict=True):
            if replica is not None and replica.size == sizes[i]:
                out[i] = replica
            else:
                elsewhere.append(keys[i])
        if elsewhere:  # all zeros in another segment: gone before anyone is told of it
            store.batch_remove(elsewhere, True)
        return out

    # --- the replica cache ------------------------------------------------------------------------

    def _hot(
        self, keys: Sequence[str], fits: Callable[[int, int], bool]
    ) -> dict[int, tuple[str, int, bytes]]:
        """Index -> (key, object bytes, digest) of the keys read within `replica_cache_s` whose
        object fits where it is asked to go; ends the sessions of those cached longer."""
        ttl = self.settings.replica_cache_s
        if ttl <= 0:
            return {}
        now = time.monotonic()
        hot: dict[int, tuple[str, int, bytes]] = {}
        stale: list[str] = []
        with self._cache_lock:
            for i, key in enumerate(keys):
                r = self._replicas.get(key)
                if r is None:
                    continue
                if now - r[0] >= ttl:
                    stale.append(key)
                elif fits(i, r[1]):
                    hot[i] = (key, r[1], r[2])
        self._forget(stale)
        return hot

    def _remember(self, fresh: Sequence[tuple[str, int, bytes]]) -> None:
        """Start a get session for objects just read and verified (the master's replica
        lookup, once, cached by the client) and keep (when, object bytes, digest) of each."""
        ttl = self.settings.replica_cache_s
        if ttl <= 0 or not fresh:
            return
        # a key's first read only notes it (a one-off read pays no second round trip); one
        # read again within `replica_cache_s` is cached
        now = time.monotonic()
        again: list[tuple[str, int, bytes]] = []
        with self._cache_lock:
            for f in fresh:
                first = self._seen.pop(f[0], None)
                if first is not None and now - first < ttl:
                    again.append(f)
                else:
                    self._seen[f[0]] = now
            while self._seen:  # oldest first: drop those past `ttl`, and any beyond the bound
                key, t = next(iter(self._seen.items()))
                if now - t < ttl and len(self._seen) <= REPLICA_CACHE_KEYS:
                    break
                del self._seen[key]
        if not again:
            return
        codes = self._store.batch_get_session_start([k for k, _, _ in again])
        with self._cache_lock:
            for (key, size, digest), code in zip(again, codes, strict=True):
                if int(code) == 0:
                    self._replicas[key] = (now, size, digest)
            excess = len(self._replicas) - REPLICA_CACHE_KEYS
            oldest = sorted(self._replicas, key=lambda k: self._replicas[k][0])[:excess]
        self._forget(oldest)

    def _forget(self, keys: Sequence[str]) -> None:
        """End the get sessions of `keys` (read afresh next time)."""
        if not keys:
            return
        with self._cache_lock:
            gone = [k for k in keys if self._replicas.pop(k, None) is not None]
            for k in keys:
                self._local.pop(k, None)
                self._located.pop(k, None)
        if gone and not self._closed:
            self._store.batch_get_session_end(gone)

    def put(self, key: str, data: Any, *, local: bool = True) -> None:
        """Store one payload from ordinary memory (copied by the client; `put_from` avoids
        the copy). `StoreUnavailable` / `StoreFull` / `StoreError` when it is not stored."""
        store = self._live()
        digest = checksum(data)
        if local and self.settings.segment_bytes > 0:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.preferred_segment = self.segment
            rc = int(store.put_parts(key, data, digest, config=config))
        else:
            rc = int(store.put_parts(key, data, digest))
        if rc in _UNREACHABLE:
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        if rc == NO_AVAILABLE_HANDLE:
            raise StoreFull(f"Mooncake Store has no room for {key!r}")
        if rc not in (0, OBJECT_ALREADY_EXISTS):
            raise StoreError(f"put of {key!r} failed with {rc}")

    def put_raw(self, key: str, data: Any) -> int:
        """Store `data` as the whole object, no digest added (what a corrupted or foreign
        writer leaves; tests use it). Mooncake's code."""
        return int(self._live().put(key, data))

    def sizes(self, keys: Sequence[str]) -> list[int]:
        """Each object's payload size, or `MISSING`."""
        store = self._live()
        out = []
        for key in keys:
            n = int(store.get_size(key))
            if n in _UNREACHABLE:
                raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
            out.append(n - CHECKSUM_BYTES if n >= CHECKSUM_BYTES else MISSING)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._live().batch_is_exist(list(keys))
        if any(int(c) < 0 for c in codes):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        return [int(c) == 1 for c in codes]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove the objects (readers' leases notwithstanding); per key whether it was there."""
        self._forget(keys)
        codes = self._live().batch_remove(list(keys), True)
        if any(int(c) in _UNREACHABLE for c in codes):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        return [int(c) == 0 for c in codes]
