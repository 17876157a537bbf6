"""The connector's saves and loads through Mooncake Store directly (`kv_connector_extra_config.
store`), the sidecar's HTTP batch calls left out of the data path: a save is one gather into
staging registered with the store and one batch put from it; a load is one batch get into
registered slots, each payload verified in place, and one scatter. No Python `bytes` per artifact.

**Staging.** Two host regions (saves, loads), each registered with the store client once:
pinned memory for a CUDA cache (the copies between device and host are asynchronous DMA into
it), ordinary memory on CPU. A save or load takes an extent `[n, local_heads, payload bytes]`
followed by one `CHECKSUM_BYTES` digest slot per payload; objects are payload then digest
(`StoreClient.put_split` / `get_split`), the same bytes the sidecar's store tier writes and reads,
so either side reads what the other wrote.

**Sizes.** A save that finds no free extent is dropped (a future miss, never a stall of the
engine); a load larger than the load region goes in rounds of whole blocks.

**The sidecar** still answers the scheduler's lookups, indexes and publishes the blocks: the
connector reports what it stored (`SidecarClient.report_store`) and the keys a load found
missing or corrupted (a corrupted object is also removed from the store, so a later save
writes it again rather than meeting `OBJECT_ALREADY_EXISTS`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.mooncake_store import (
    CHECKSUM_BYTES,
    CORRUPTED,
    MISSING,
    ClientSettings,
    MasterAddress,
    StoreClient,
    StoreError,
)
from workers.vllm_connector.gpu import CudaPagedKV, LoadStaging, StagedSave
from workers.vllm_connector.load import LoadOutcome
from workers.vllm_connector.payload import WorkerKV
from workers.vllm_connector.plan import ConnectorSettings

STAGING_BYTES = 512 << 20
"""Bytes of each registered staging region (saves, loads) by default."""
ALIGN = 4096
"""Extents start on page boundaries."""


class RegisteredRegion:
    """Host memory registered with a store client once (`pinned` for a CUDA cache), handed out
    as extents (`take` / `give`; first fit, thread-safe)."""

    def __init__(self, client: StoreClient, nbytes: int, *, pinned: bool) -> None:
        if nbytes <= 0:
            raise ValueError("a registered region needs at least one byte")
        nbytes = -(-nbytes // ALIGN) * ALIGN  # whole pages, as its extents
        self.nbytes = nbytes
        self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.address = int(self.memory.data_ptr())
        self._client: StoreClient | None = client
        client.register(self.address, nbytes)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), by offset

    def take(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(offset, uint8 view) of `nbytes` free bytes, or None when no free run is that long."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for i, (offset, run) in enumerate(self._free):
                if run >= size:
                    if run == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, run - size)
                    return offset, self.memory[offset : offset + nbytes]
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Return an extent `take` handed out."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            runs = sorted([*self._free, (offset, size)])
            merged: list[tuple[int, int]] = []
            for o, n in runs:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def close(self) -> None:
        if self._client is not None:
            self._client.unregister(self.address)
            self._client = None


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """What a save put: (key, payload bytes, checksum) of each object stored (or already
    there), and the keys the store did not take."""

    stored: list[tuple[str, int, bytes]]
    refused: list[str]


@dataclass(frozen=True, slots=True)
class StoreLoadOutcome:
    """A load through the store: what it wrote (`load`), and the keys it found missing or
    corrupted (the sidecar stops holding them)."""

    load: LoadOutcome
    dropped: list[str]


class StagedStore:
    """A save's blocks in registered staging: `n` blocks of `heads` payloads, then the digest
    slots; `staged` waits for a CUDA cache's copy down."""

    __slots__ = ("__weakref__", "_give", "digests", "n", "offset", "size", "staged", "units")

    def __init__(
        self,
        offset: int,
        size: int,
        units: torch.Tensor,
        digests: torch.Tensor,
        staged: StagedSave | None,
    ) -> None:
        self.offset, self.size = offset, size
        self.units, self.digests, self.staged = units, digests, staged
        self.n = int(units.shape[0])
        self._give: weakref.finalize[..., object] | None = None

    def wait(self) -> None:
        if self.staged is not None:
            self.staged.wait()

    def release(self) -> None:
        """Give the extent back once any copy into it is done (at most once)."""
        self.wait()
        if self._give is not None:
            self._give()


class StoreKV:
    """One rank's cache saved to and loaded from Mooncake Store through `client` (see the
    module docstring). `gather` runs on the engine's thread, `put` on the save thread, `load`
    on the load thread."""

    def __init__(
        self,
        client: StoreClient,
        kv: WorkerKV,
        *,
        staging_bytes: int = STAGING_BYTES,
        local: bool = True,
    ) -> None:
        self.client = client
        self.kv = kv
        self.local = local
        pinned = isinstance(kv, CudaPagedKV) and kv.device.type == "cuda"
        self._unit = kv.payload_nbytes
        self._heads = kv.num_kv_heads
        if self._block_bytes > staging_bytes:
            raise ValueError(
                f"store staging of {staging_bytes} bytes holds no block "
                f"({self._block_bytes} bytes with digests)"
            )
        self._saves = RegisteredRegion(client, staging_bytes, pinned=pinned)
        try:
            self._loads = RegisteredRegion(client, staging_bytes, pinned=pinned)
        except BaseException:
            self._saves.close()
            raise

    @property
    def _block_bytes(self) -> int:
        return self._heads * (self._unit + CHECKSUM_BYTES)

    def _take(self, region: RegisteredRegion, n: int) -> tuple[int, int, torch.Tensor] | None:
        size = n * self._block_bytes
        got = region.take(size)
        if got is None:
            return None
        return got[0], size, got[1]

    # --- save ------------------------------------------------------------------------------------

    def gather(self, block_ids: Sequence[int]) -> StagedStore | None:
        """Copy blocks out of the cache into save staging (one gather; a CUDA cache's copy down
        goes on after this returns); None when the staging has no room (drop the save)."""
        n, h, unit = len(block_ids), self._heads, self._unit
        got = self._take(self._saves, n)
        if got is None:
            return None
        offset, size, extent = got
        units = extent[: n * h * unit].view(n, h, unit)
        digests = extent[n * h * unit :]
        try:
            staged: StagedSave | None = None
            if isinstance(self.kv, CudaPagedKV):
                staged = self.kv.gather(block_ids, host=units)
            else:  # vLLM's CPU backend: its per-head buffers [heads, n, ...] copied in once
                buffers = self.kv.gather(block_ids)
                assert isinstance(buffers, torch.Tensor)
                units.copy_(buffers.reshape(h, n, -1).view(torch.uint8).transpose(0, 1))
        except BaseException:
            self._saves.give(offset, size)
            raise
        out = StagedStore(offset, size, units, digests, staged)
        # `put` gives the extent back; a save never put gives it back when it is freed
        out._give = weakref.finalize(out, self._saves.give, offset, size)
        return out

    def put(self, staged: StagedStore, rows: Sequence[Sequence[tuple[int, str]]]) -> SaveOutcome:
        """Store `rows[i]` ((local head, key) pairs) of block `i` of `staged` in one batch put.
        `StoreUnavailable` / `StoreFull` / `StoreError` when the store took none."""
        try:
            return self._put(staged, rows)
        finally:
            staged.release()

    def _put(self, staged: StagedStore, rows: Sequence[Sequence[tuple[int, str]]]) -> SaveOutcome:
        if len(rows) != staged.n:
            raise ValueError(f"{len(rows)} key rows for {staged.n} staged blocks")
        staged.wait()
        h, unit = self._heads, self._unit
        base, dbase = int(staged.units.data_ptr()), int(staged.digests.data_ptr())
        keys: list[str] = []
        addresses: list[int] = []
        digests: list[int] = []
        for i, row in enumerate(rows):
            for j, key in row:
                u = i * h + j
                keys.append(key)
                addresses.append(base + u * unit)
                digests.append(dbase + u * CHECKSUM_BYTES)
        if not keys:
            return SaveOutcome([], [])
        codes = self.client.put_split(
            keys, addresses, [unit] * len(keys), digests, local=self.local
        )
        view = staged.digests.numpy()
        stored, refused = [], []
        for key, d, code in zip(keys, digests, codes, strict=True):
            if code == 0:
                at = d - dbase
                stored.append((key, unit, view[at : at + CHECKSUM_BYTES].tobytes()))
            else:
                refused.append(key)
        return SaveOutcome(stored, refused)

    # --- load ------------------------------------------------------------------------------------

    def load(self, rows: Sequence[Sequence[str]], block_ids: Sequence[int]) -> StoreLoadOutcome:
        """Read `rows[i]` (block `block_ids[i]`'s keys, one per local head in cache order) into
        load staging in one batch get per round (all of them when they fit), verify each
        payload there and write the blocks before the first refused one into the cache."""
        if len(rows) != len(block_ids):
            raise ValueError(f"{len(rows)} key rows for {len(block_ids)} blocks")
        for i, row in enumerate(rows):
            if len(row) != self._heads:
                raise ValueError(f"block {i}: {len(row)} keys for {self._heads} heads")
        per_round = max(1, self._loads.nbytes // self._block_bytes)
        loaded = 0
        dropped: list[str] = []
        refused: str | None = None
        for a in range(0, len(rows), per_round):
            good, why, gone = self._load_round(
                rows[a : a + per_round], block_ids[a : a + per_round]
            )
            loaded += good
            dropped.extend(gone)
            if why is not None:
                refused = why
                break
        nbytes = loaded * self._heads * self._unit
        return StoreLoadOutcome(LoadOutcome(loaded, nbytes, refused), dropped)

    def _load_round(
        self, rows: Sequence[Sequence[str]], block_ids: Sequence[int]
    ) -> tuple[int, str | None, list[str]]:
        n, h, unit = len(rows), self._heads, self._unit
        got = self._take(self._loads, n)
        if got is None:  # the load thread is the region's only user: it is free between loads
            raise RuntimeError("load staging is in use")
        offset, size, extent = got
        try:
            units = extent[: n * h * unit].view(n, h, unit)
            base = int(units.data_ptr())
            dbase = base + n * h * unit
            keys = [key for row in rows for key in row]
            addresses = [base + u * unit for u in range(n * h)]
            digests = [dbase + u * CHECKSUM_BYTES for u in range(n * h)]
            try:
                codes = self.client.get_split(keys, addresses, [unit] * len(keys), digests)
            except StoreError as exc:
                return 0, f"Mooncake Store: {exc}", []
            first = next((u for u, c in enumerate(codes) if c < 0), None)
            good = n if first is None else first // h
            why = None
            if first is not None:
                what = "missing" if codes[first] == MISSING else "corrupted"
                why = f"{keys[first]}: {what} in Mooncake Store"
            gone = [k for k, c in zip(keys, codes, strict=True) if c in (MISSING, CORRUPTED)]
            corrupted = [k for k, c in zip(keys, codes, strict=True) if c == CORRUPTED]
            if corrupted:
                with contextlib.suppress(StoreError):  # the next reader removes it again
                    self.client.remove(corrupted)
            if good:
                if isinstance(self.kv, CudaPagedKV):
                    self.kv.scatter_staged(LoadStaging(units), block_ids[:good])
                else:
                    slots = units.numpy()
                    payloads = [[memoryview(slots[i, j]) for j in range(h)] for i in range(good)]
                    self.kv.scatter_payloads(payloads, block_ids[:good])
            return good, why, gone
        finally:
            self._loads.give(offset, size)

    def close(self) -> None:
        """Unregister the staging (the client stays the caller's)."""
        self._saves.close()
        self._loads.close()


def open_store_kv(settings: ConnectorSettings, kv: WorkerKV, *, host: str = "127.0.0.1") -> StoreKV:
    """A store client set up from the connector's settings (`store`, `store_segment_bytes`,
    `store_staging_bytes`, `store_digest_threads`, `store_replica_cache_s`) and the cache's
    `StoreKV` on it;
    `StoreUnavailable` when the master does not answer."""
    if settings.store is None:
        raise ValueError("the connector has no store configured")
    client = StoreClient.open(
        ClientSettings(
            MasterAddress.parse(settings.store),
            local_host=host,
            segment_bytes=settings.store_segment_bytes,
            digest_threads=settings.store_digest_threads,
            replica_cache_s=settings.store_replica_cache_s,
        )
    )
    try:
        return StoreKV(client, kv, staging_bytes=settings.store_staging_bytes)
    except BaseException:
        client.close()
        raise
