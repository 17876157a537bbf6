"""A typed client of Mooncake Store (`mooncake.store.MooncakeDistributedStore`, the distributed
KV store of the Mooncake paper, FAST'25, used by vLLM's Mooncake store connector, SGLang HiCache
and LMCache): setup against a master, registered buffers, batch puts from and gets into
registered memory, remove, exists; every object carries its checksum and is verified on load.

**Object layout.** An artifact of n bytes is stored as one object of n + 16 bytes: the payload,
then its XXH3-128 digest (the sidecar's artifact checksum, `workers.sidecar.store.checksum`).
A reader needs nothing but the key: `get_into` reads the object into a slot, hashes the payload
in place and compares it with the trailer. A writer leaves 16 writable bytes after each payload
in its buffer (`put_from` writes the digest there), so a save is gather, hash, one batch put,
with no Python `bytes` per artifact. Payloads packed back to back (a staging buffer's) go with
their digests in a separate registered slot each (`put_split`, `get_split`: the store's
multi-buffer batch calls; the object's bytes are the same).

**Errors.** The binding answers status integers (Mooncake's `ErrorCode`,
`mooncake-store/include/types.h`); here the master out of reach (`RPC_FAIL`, `RPC_TIMEOUT`) is
`StoreUnavailable` for the whole call. A key the store does not hold (`OBJECT_NOT_FOUND`), a
replica not readable (`REPLICA_IS_NOT_READY`), one whose read outlasted its lease
(`LEASE_EXPIRED`: the master may have evicted it meanwhile, so the bytes are not trusted) or
one whose segment's process is gone (`TRANSFER_FAIL`) reads as `MISSING`; a payload that fails
its digest as `CORRUPTED`.

Calls block (a master round trip, then the transfer); the caller runs them off its event loop
(`workers.sidecar.store_tier`). Measured on loopback TCP (2-core VM): a get ~0.3 ms + transfer;
with the master killed, a get fails in ~4 ms, `is_exist` and puts in ~4.3 s (the client's own
reconnect), and a master restarted on the same ports serves the clients again (their segments
re-mounted, the objects of before gone).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from workers.mooncake_store.master import MasterAddress, master_answers

CHECKSUM_BYTES = 16
"""Bytes of the XXH3-128 digest stored after every payload."""
PARALLEL_DIGEST_BYTES = 4 << 20
"""Below this many payload bytes a batch is hashed on the calling thread."""

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


def checksum(data: Any) -> bytes:
    """The artifact checksum: the XXH3-128 digest of a bytes-like payload."""
    return xxhash.xxh3_128_digest(data)


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


class StoreClient:
    """One `MooncakeDistributedStore` set up against a master (`open`). Methods block; the
    answers per key keep the order of the keys asked for."""

    def __init__(self, store: Any, settings: ClientSettings) -> None:
        self._store = store
        self.settings = settings
        self.segment: str = store.get_hostname()
        """This client's segment name (host:port), what `put_from(local=True)` prefers."""
        self._closed = False
        self._digest_pool = (
            ThreadPoolExecutor(settings.digest_threads, thread_name_prefix="store-digest")
            if settings.digest_threads > 1
            else None
        )

    def _digests(self, addresses: Sequence[int], sizes: Sequence[int]) -> list[bytes]:
        """The checksum of each payload, on the digest threads when they are worth it."""
        views = [memory_at(a, n) for a, n in zip(addresses, sizes, strict=True)]
        pool = self._digest_pool
        if pool is None or len(views) < 2 or sum(sizes) < PARALLEL_DIGEST_BYTES:
            return [checksum(v) for v in views]
        per = -(-len(views) // self.settings.digest_threads)
        return list(pool.map(checksum, views, chunksize=per))

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

    def unregister(self, address: int) -> None:
        if not self._closed:
            self._store.unregister_buffer(address)

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
        codes = self._live().batch_get_into(list(keys), list(addresses), list(capacities))
        out: list[int] = []
        for key, address, n in zip(keys, addresses, codes, strict=True):
            n = int(n)
            if n in _UNREACHABLE:
                raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
            if n < 0:
                if n in _UNREADABLE:
                    out.append(MISSING)
                    continue
                if n == INVALID_PARAMS:  # larger than the slot: not the artifact listed
                    out.append(CORRUPTED)
                    continue
                raise StoreError(f"get of {key!r} failed with {n}")
            size = n - CHECKSUM_BYTES
            if size < 0:
                out.append(CORRUPTED)
                continue
            view = memory_at(address, n)
            out.append(size if checksum(view[:size]) == view[size:] else CORRUPTED)
        return out

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
        parts = [[a, d] for a, d in zip(addresses, digests, strict=True)]
        lengths = [[size, CHECKSUM_BYTES] for size in sizes]
        codes = self._live().batch_get_into_multi_buffers(list(keys), parts, lengths)
        out: list[int] = []
        read = [i for i, n in enumerate(codes) if int(n) == sizes[i] + CHECKSUM_BYTES]
        values = self._digests([addresses[i] for i in read], [sizes[i] for i in read])
        computed = dict(zip(read, values, strict=True))
        for i, (key, size, digest, n) in enumerate(zip(keys, sizes, digests, codes, strict=True)):
            n = int(n)
            if n in _UNREACHABLE:
                raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
            if n < 0:
                # a larger object fails its transfer (TRANSFER_FAIL), a smaller one is
                # INVALID_PARAMS: neither is the artifact listed
                if n in _UNREADABLE or n == INVALID_PARAMS:
                    out.append(MISSING if n in _UNREADABLE else CORRUPTED)
                    continue
                raise StoreError(f"get of {key!r} failed with {n}")
            if n != size + CHECKSUM_BYTES:
                out.append(CORRUPTED)
                continue
            ok = computed[i] == memory_at(digest, CHECKSUM_BYTES)
            out.append(size if ok else CORRUPTED)
        return out

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
        codes = self._live().batch_remove(list(keys), True)
        if any(int(c) in _UNREACHABLE for c in codes):
            raise StoreUnavailable(f"Mooncake master {self.settings.master.rpc} unreachable")
        return [int(c) == 0 for c in codes]
