"""The sidecar's artifact tier on Mooncake Store (`--store mooncake://HOST:PORT`): the bytes of
every artifact the worker saves live in the store (in this sidecar's own segment when it has
room), and a fetch from a peer sidecar is this sidecar's store client reading what the peer put.

What the sidecar *holds* (what it indexes, lists to peers and publishes to the directory) is
what it put or fetched and could read whole, and what the engine's connector put into the
store itself and reported (`adopt`, found in the store): `held`. The store may lose an object
behind it (evicted, its segment's process gone, the master restarted); the next read finds it
missing and the sidecar drops it, as it drops a corrupted one (the object is then also
removed from the store).

Losses nobody reads are found by `audit`, which the sidecar runs before each renewal of its
replicas: one existence check of every held key (`batch_is_exist`, in calls of
`AUDIT_KEYS`), and what the store no longer has is no longer held, so the renewal withdraws
its blocks from the directory (`workers.sidecar.publisher`). The master is where the
knowledge is: it drops a client's objects once the client misses its heartbeats for the
master's client TTL (`--client_ttl`, 10 s by default; 2.8 s after a SIGKILL with a
TTL of 2 s, measured), the same way for a dead segment, an eviction or a master restarted
empty. The alternatives know less: a failed read knows only the keys someone read; the
router's death handling of a worker knows that worker's replicas, not those of the
survivors that fetched from it (a fetch through the store copies nothing: the fetcher's
"replica" is the same object, in the dead worker's segment); and the Python API lists no
segments. So a lost artifact leaves the directory within the master's client TTL plus one
renewal interval (`--replica-ttl-s` / 3), at the cost of one existence check per held key per
renewal (the renewal already writes one directory line per held block).

Every read is verified against the digest stored with the object
(`workers.mooncake_store.client`); an artifact the connector's GPU path wrote (a keyed-MAC
digest) is served with its XXH3-128 checksum, what HTTP readers check.

Store calls run on this tier's threads with a deadline (`timeout_s` plus the bytes at
`MIN_RATE_BPS`): a master that is down fails the call with `StoreUnavailable` within it, never
holding the event loop. Each staging buffer is used by one call at a time, and a call given up
keeps its buffer until the engine lets go of it (a transfer may still be writing there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from workers.mooncake_store import (
    CHECKSUM_BYTES,
    CORRUPTED,
    MISSING,
    ClientSettings,
    MasterAddress,
    RegisteredBuffer,
    StoreClient,
    StoreError,
    StoreFull,
    StoreUnavailable,
    checksum,
)
from workers.mooncake_store.digest import is_mac
from workers.sidecar.store import ArtifactCorrupted, ArtifactMissing, ArtifactTooLarge

STAGING_BYTES = 64 << 20
"""Bytes of each registered staging buffer (one for puts, one for reads)."""
MIN_RATE_BPS = 250e6
"""The slowest transfer rate a call is given time for, on top of `timeout_s`."""
AUDIT_KEYS = 8192
"""Most keys one existence check of `audit` asks the master about."""
REPLICA_CACHE_S = 5.0
"""The client's replica cache (`ClientSettings.replica_cache_s`): artifacts read again within
it skip the master's lookup (bench/history/mooncake_store.md)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HeldArtifact:
    """An artifact this sidecar put or fetched, as it last read or wrote it."""

    key: str
    size_bytes: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What `StoreTier.fetch` read: keys now held, and those not readable or failing their
    digest (the latter also removed from the store)."""

    held: list[str]
    missing: list[str]
    corrupted: list[str]
    bytes: int


class StoreTier:
    """The store-backed artifacts of one sidecar (see the module docstring)."""

    def __init__(
        self,
        client: StoreClient,
        *,
        staging_bytes: int = STAGING_BYTES,
        timeout_s: float = 5.0,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.staging_bytes = staging_bytes
        self._put_buf = client.buffer(staging_bytes)
        self._get_buf = client.buffer(staging_bytes)
        self._put_lock = threading.Lock()
        self._get_lock = threading.Lock()
        self._held: dict[str, HeldArtifact] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-store")

    @classmethod
    def open(
        cls,
        master: MasterAddress,
        *,
        host: str = "127.0.0.1",
        segment_bytes: int = 1 << 30,
        staging_bytes: int = STAGING_BYTES,
        timeout_s: float = 5.0,
        replica_cache_s: float = REPLICA_CACHE_S,
    ) -> StoreTier:
        """Set up a client against `master`; `StoreUnavailable` when it does not answer."""
        client = StoreClient.open(
            ClientSettings(
                master,
                local_host=host,
                segment_bytes=segment_bytes,
                replica_cache_s=replica_cache_s,
                direct_reads=True,
            )
        )
        try:
            return cls(client, staging_bytes=staging_bytes, timeout_s=timeout_s)
        except BaseException:
            client.close()
            raise

    @property
    def master(self) -> MasterAddress:
        return self.client.settings.master

    # --- what is held (no store call) -----------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self._held

    def held(self, key: str) -> HeldArtifact | None:
        return self._held.get(key)

    def forget(self, key: str) -> bool:
        """Stop holding `key` (the object stays in the store for whoever else holds it)."""
        return self._held.pop(key, None) is not None

    async def adopt(self, artifacts: Sequence[HeldArtifact]) -> list[bool]:
        """Hold artifacts another client of the same store put (the engine's connector writes
        the store directly and reports them): one existence check, then each object found is
        held as reported (its digest travels with it: every reader verifies). Per artifact,
        whether it is held now; `StoreUnavailable` when the store cannot be reached."""
        keys = [a.key for a in artifacts]
        found = await self._call(0, lambda: self.client.exists(keys)) if keys else []
        for artifact, there in zip(artifacts, found, strict=True):
            if there:
                self._held[artifact.key] = artifact
        return found

    async def audit(self) -> list[str]:
        """Stop holding what the store no longer has: one existence check of every held key
        (in calls of `AUDIT_KEYS`). The keys dropped; `StoreUnavailable` when the store cannot
        be reached (nothing dropped: a master out of reach says nothing of its objects)."""
        asked = list(self._held.items())
        lost: list[str] = []
        for start in range(0, len(asked), AUDIT_KEYS):
            part = asked[start : start + AUDIT_KEYS]
            keys = [key for key, _ in part]
            found = await self._call(0, functools.partial(self.client.exists, keys))
            for (key, held), there in zip(part, found, strict=True):
                # a key put anew while the check ran is the new object's: left alone
                if not there and self._held.get(key) is held:
                    del self._held[key]
                    lost.append(key)
        return lost

    def count(self) -> int:
        return len(self._held)

    def held_bytes(self) -> int:
        return sum(a.size_bytes for a in self._held.values())

    # --- store calls ----------------------------------------------------------------------------

    async def _call(self, nbytes: int, fn: Callable[[], T]) -> T:
        deadline = self.timeout_s + nbytes / MIN_RATE_BPS
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        try:
            async with asyncio.timeout(deadline):
                return await future
        except TimeoutError:
            raise StoreUnavailable(
                f"Mooncake Store at {self.master.rpc} did not answer within {deadline:.1f} s"
            ) from None

    async def put(self, key: str, data: bytes, expected: bytes | None = None) -> HeldArtifact:
        """Store one artifact; `ArtifactCorrupted` when `expected` is not its checksum,
        `ArtifactTooLarge` when the store has no room, `StoreUnavailable` / `StoreError`
        when the store did not take it."""
        digest = checksum(data)
        if expected is not None and expected != digest:
            raise ArtifactCorrupted(f"{key}: bytes do not match the expected checksum")
        old = self._held.get(key)
        size = len(data)

        def run() -> None:
            if old is not None and old.checksum != digest:
                self.client.remove([key])  # a new value: the store keeps the first otherwise
            if size + CHECKSUM_BYTES <= self.staging_bytes:
                with self._put_lock:
                    self._put_buf.view[:size] = data
                    codes = self.client.put_from([key], [self._put_buf.address], [size])
                if codes[0] != 0:
                    raise StoreError(f"put of {key!r} failed with {codes[0]}")
            else:
                self.client.put(key, data)

        try:
            await self._call(size, run)
        except StoreFull as exc:
            raise ArtifactTooLarge(str(exc)) from exc
        held = HeldArtifact(key, size, digest)
        self._held[key] = held
        return held

    async def get(self, key: str) -> tuple[bytes, bytes]:
        """A held artifact's bytes and checksum, verified; `ArtifactMissing` when not held or
        no longer readable, `ArtifactCorrupted` when its bytes fail their digest (both stop
        holding it)."""
        held = self._held.get(key)
        if held is None:
            raise ArtifactMissing(key)
        cap = held.size_bytes + CHECKSUM_BYTES

        def run() -> tuple[int, bytes]:
            if cap <= self.staging_bytes:
                with self._get_lock:
                    return self._read_one(self._get_buf, key, cap)
            buf = self.client.buffer(cap)
            try:
                return self._read_one(buf, key, cap)
            finally:
                buf.close()

        n, data = await self._call(cap, run)
        if n == MISSING:
            self._held.pop(key, None)
            raise ArtifactMissing(key)
        if n == CORRUPTED:
            await self._drop_corrupted([key])
            raise ArtifactCorrupted(f"{key}: failed its checksum in the store and was dropped")
        digest = data[n:]
        if is_mac(digest):  # the connector's GPU path wrote it; HTTP readers check XXH3
            digest = checksum(data[:n])
        self._held[key] = HeldArtifact(key, n, digest)
        return data[:n], digest

    def _read_one(self, buf: RegisteredBuffer, key: str, cap: int) -> tuple[int, bytes]:
        n = self.client.get_into([key], [buf.address], [cap])[0]
        if n < 0:
            return n, b""
        return n, bytes(buf.view[: n + CHECKSUM_BYTES])

    async def _drop_corrupted(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._held.pop(key, None)
        with contextlib.suppress(StoreError):  # the reader that finds it next drops it again
            await self._call(0, lambda: self.client.remove(keys))

    async def fetch(self, keys: Sequence[str], sizes: Sequence[int | None]) -> FetchResult:
        """Read `keys` (payload sizes as the source listed them, None: ask the store) through
        this sidecar's client, each verified in registered memory, and hold those that were
        whole. `StoreUnavailable` when the store cannot be reached."""
        keys = list(keys)
        return await self._call(sum(s or 0 for s in sizes), lambda: self._fetch(keys, sizes))

    def _fetch(self, keys: list[str], sizes: Sequence[int | None]) -> FetchResult:
        unknown = [k for k, s in zip(keys, sizes, strict=True) if s is None]
        asked = dict(zip(unknown, self.client.sizes(unknown), strict=True)) if unknown else {}
        plan = [(k, s if s is not None else asked[k]) for k, s in zip(keys, sizes, strict=True)]
        held: list[str] = []
        missing: list[str] = []
        corrupted: list[str] = []
        total = 0
        batch: list[tuple[str, int]] = []
        used = 0

        def read(batch: list[tuple[str, int]], buf: RegisteredBuffer) -> None:
            nonlocal total
            addresses, caps, offset = [], [], 0
            for _, size in batch:
                addresses.append(buf.address + offset)
                caps.append(size + CHECKSUM_BYTES)
                offset += size + CHECKSUM_BYTES
            got = self.client.get_into([k for k, _ in batch], addresses, caps)
            for (key, _), address, n in zip(batch, addresses, got, strict=True):
                if n == MISSING:
                    missing.append(key)
                elif n == CORRUPTED:
                    corrupted.append(key)
                else:
                    digest = bytes(buf.view[address - buf.address + n :][:CHECKSUM_BYTES])
                    self._held[key] = HeldArtifact(key, n, digest)
                    held.append(key)
                    total += n

        with self._get_lock:
            for key, size in plan:
                if size < 0:
                    missing.append(key)
                    continue
                cap = size + CHECKSUM_BYTES
                if cap > self.staging_bytes:
                    big = self.client.buffer(cap)
                    try:
                        read([(key, size)], big)
                    finally:
                        big.close()
                    continue
                if used + cap > self.staging_bytes:
                    read(batch, self._get_buf)
                    batch, used = [], 0
                batch.append((key, size))
                used += cap
            if batch:
                read(batch, self._get_buf)
        for key in missing + corrupted:
            self._held.pop(key, None)
        if corrupted:
            with contextlib.suppress(StoreError):
                self.client.remove(corrupted)
        return FetchResult(held, missing, corrupted, total)

    def close(self) -> None:
        """Stop the threads (a call still running is left to end) and the client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._put_lock:
            self._put_buf.close()
        with self._get_lock:
            self._get_buf.close()
        self.client.close()
