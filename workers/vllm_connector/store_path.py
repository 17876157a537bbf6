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

**Zero copy** (a CUDA cache with a store client that mounts its own segment: `zero_copy`, on
by default there): the store's host copy and the CPU hashing leave the path.
- A save gathers into device staging (`CudaPagedKV.device_gather`), frames the objects there
  with their digests in one pass (`gpu_digest.frame`, the keyed MAC), reserves the objects in
  the client's own segment (`StoreClient.reserve_local`) and copies them down straight into the
  store's memory, one strided DMA copy per run of objects (`host_copy`); reservations go by
  `chunk_objects`, every chunk's round trips at once on `rpc_threads` threads (the binding
  lets go of the GIL), each chunk's copy queued as soon as its answer is in.
  The blocks are reported only after the copies are done. An object the store placed elsewhere
  goes through registered staging and `put_objects` (same bytes, digest included).
- A load looks up where the objects are (`StoreClient.local_replicas`, cached for
  `replica_cache_s`), copies those in this process's segment up by strided DMA, checks each
  digest on the device while it unframes the payloads (`gpu_digest.unframe`) and scatters the
  good prefix. An object not readable that way (in another segment, an XXH3 digest, a
  replica that moved: the keyed digest fails) is read through `get_split`, verified on the CPU,
  and copied up.

**Round trips ahead.** A transfer's master round trips can be asked for as soon as its keys
are known, so none is left inside it: `reserve` / `reserve_groups` / `reserve_rows` submit a
save's reservations to the RPC threads (the connector does so when it binds the step's
metadata, before the forward pass) and `gather(reserving=)` takes them; `resolve` looks a
coming load's replicas up, and the load answers its lookups from the replica cache with no
round trip (an address gone stale by then fails the keyed digest and is read afresh, as any
cached replica).

**Object granularity.** `put` / `load` keep one object per block per KV head (the sidecar's
artifacts, what the connector saves). `put_groups` / `load_groups` are the grouped layout: one
object per group of blocks holding every KV head (`plan.object_groups`: cut at the request's
multiples of `plan.BLOCKS_PER_OBJECT`, keyed `plan.group_key` by the last block's chain hash),
payload `[blocks, heads, payload]` then one digest, so every reader verifies it as any other
object (`digest.verify`). 8x-64x fewer keys a request, so the master's metadata stops bounding
a transfer. A TP-mismatched reader reads whole objects (a TP-2 rank twice its bytes), verifies
them and takes its heads (`object_heads`, `first_head`); a saver must hold every head its keys
name. Zero copy: the save's gather and its digests (`gpu_digest.digests`, read in place) are
one CUDA graph replay over a `SaveSlot` of the request's shape (`graphs.Captured`: the host
cost of one replay, ~0.014 ms, where the Triton launches cost ~0.2-0.4 ms each), then the
reservations are asked for (`gather(groups=)`, on the RPC threads) and each object's payload
and then its digest go straight from the slot into the store's memory on a copy stream. The
load copies the objects up on the copy stream into a `LoadSlot`; as each chunk's copies are
queued, one replay checks and unframes its objects (`gpu_digest.unframe`) and scatters their
blocks while later chunks are still copied, the last object in a replay of its own
(`part_ends`), each block written only where the flags of its object and all before it are
set, read on the device (`kernels.merge_heads_gated`): the host waits once, at the end
(`_load_groups_gated`; the chunked load that read each chunk's flags on the host,
`_load_groups_device`, is kept behind `gated_load` to compare). Round trips go in chunks of
1, 2, 4, ... objects (`first_chunk_objects`, `chunk_bounds`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kernels import merge_heads_gated, split_heads
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    CORRUPTED,
    EXISTS,
    MISSING,
    ClientSettings,
    MasterAddress,
    Replica,
    StoreClient,
    StoreError,
)
from workers.mooncake_store.digest import key_lanes
from workers.vllm_connector import gpu_digest
from workers.vllm_connector.gpu import CudaPagedKV, LoadStaging, StagedSave
from workers.vllm_connector.graphs import Captured, Slots
from workers.vllm_connector.host_copy import HostSegments, copy_rows, cuda_runtime, strided_runs
from workers.vllm_connector.load import LoadOutcome
from workers.vllm_connector.payload import WorkerKV
from workers.vllm_connector.plan import ConnectorSettings, ObjectGroup

STAGING_BYTES = 512 << 20
"""Bytes of each registered staging region (saves, loads) by default."""
ALIGN = 4096
"""Extents start on page boundaries."""
RPC_THREADS = 4
"""Threads that run a zero-copy save's or load's master round trips, every chunk's at once."""
UNREAD = -9
"""A zero-copy load's code for a key not read yet (neither missing nor corrupted)."""
CHUNK_OBJECTS = 64
"""Objects per master round trip of a zero-copy save or load (the next chunk's round trip
overlaps this one's copy)."""
FIRST_CHUNK_OBJECTS = 1
RESOLVING_KEYS = 65536
"""Keys of `StoreKV.resolve` lookups kept for loads not run yet (beyond: the oldest dropped)."""
"""Objects in a grouped zero-copy save's or load's first round trip (`chunk_bounds`)."""


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


@dataclass(slots=True)
class Reserving:
    """A grouped zero-copy save's reservations (`StoreClient.reserve_local`) on the store's RPC
    threads, asked for before its gather ran: chunk `bounds[i]` of `keys` is `futures[i]`."""

    keys: list[str]
    sizes: list[int]
    bounds: list[tuple[int, int]]
    futures: list[Future[list[Replica | int | None]]]
    taken: bool = False
    """`put_groups` took them over (and removes what it does not write)."""
    lanes: np.ndarray | None = None
    """A grouped save's key terms (`StoreKV._lanes` of its groups), computed with the
    reservations, off the save's path."""

    def cancel(self, client: StoreClient) -> None:
        """Remove what was reserved for a save dropped before its put (objects never written)."""
        if self.taken:
            return
        self.taken = True
        reserved: list[str] = []
        for (a, b), future in zip(self.bounds, self.futures, strict=True):
            with contextlib.suppress(Exception):
                got = future.result()
                reserved += [
                    k for k, r in zip(self.keys[a:b], got, strict=True) if isinstance(r, Replica)
                ]
        if reserved:
            with contextlib.suppress(StoreError):
                client.remove(reserved)


@dataclass(slots=True)
class SaveSlot:
    """A grouped zero-copy save's device work for one shape (`n` blocks cut into groups of
    these counts), over buffers of its own: the ids and key terms go up from `host` into `up`,
    then one replay of `launches` gathers the blocks into `staging` and writes each group's
    digest into `digests`; the upload is part of the replay (a pinned host buffer's copy is a
    graph node like the kernels)."""

    staging: torch.Tensor
    digests: torch.Tensor
    host: torch.Tensor
    up: torch.Tensor
    launches: Captured
    done: torch.cuda.Event | None = None
    """Recorded after the last replay (`host` may be written again once it is), re-recorded by
    every save that takes the slot."""


@dataclass(slots=True)
class LoadSlot:
    """A grouped zero-copy load's device work for one shape, over buffers of its own: objects
    come up into `objects`; `parts[k]` checks and unframes objects `[ends[k - 1], ends[k])`
    (from 0 for the first) into `units`, clears the flags of those not copied (`copied`) and
    scatters their blocks where the verified prefix allows (`merge_heads_gated`); `host` -> `up`
    holds the block ids, each block's group (written once, the slot's shape) and the key terms,
    uploaded by the first part's replay, and each part uploads its `copied_host` flags first
    (pinned host copies are graph nodes like the kernels)."""

    objects: torch.Tensor
    units: torch.Tensor
    flags: torch.Tensor
    host: torch.Tensor
    up: torch.Tensor
    copied_host: torch.Tensor
    copied: torch.Tensor
    parts: list[Captured]
    ends: tuple[int, ...]


class _Current:
    """`stream` and its device current for the block, the previous ones back after it: what
    `torch.cuda.device` and `torch.cuda.stream` nested do, in two calls on each side (the
    store path switches a few times per save and load, host time before its copies)."""

    __slots__ = ("_device", "_prev", "_prev_device", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._device = stream.device_index
        self._prev: torch.cuda.Stream | None = None
        self._prev_device = -1

    def __enter__(self) -> None:
        self._prev_device = torch.cuda.current_device()
        self._prev = torch.cuda.current_stream(self._device)
        torch.cuda.set_stream(self._stream)  # makes its device current too

    def __exit__(self, *exc: object) -> None:
        assert self._prev is not None
        torch.cuda.set_stream(self._prev)
        if self._prev_device != self._device:
            torch.cuda.set_device(self._prev_device)


def part_ends(bounds: Sequence[tuple[int, int]], m: int) -> tuple[int, ...]:
    """Where a gated load's checked parts end: at each chunk's end (`bounds`, the order the
    replicas are answered and copied in), and the last object alone, so that once the last copy
    lands only one object's check and scatter is left (the others ran while it was copied)."""
    ends = {b for _a, b in bounds if b > 0}
    if m > 1:
        ends.add(m - 1)
    return tuple(sorted(ends))


def _groups_of(counts: Sequence[int]) -> list[ObjectGroup]:
    """Unnamed groups of these block counts, in order (a shape's layout)."""
    out, at = [], 0
    for c in counts:
        out.append(ObjectGroup("", at, c))
        at += c
    return out


def chunk_bounds(m: int, first: int, most: int) -> list[tuple[int, int]]:
    """`[a, b)` chunks of `m` objects for master round trips: the first of `first` objects (its
    copy starts early), each next twice the last, at most `most`."""
    out: list[tuple[int, int]] = []
    a, size = 0, max(1, min(first, most))
    while a < m:
        b = min(m, a + size)
        out.append((a, b))
        a, size = b, min(most, size * 2)
    return out


class StagedStore:
    """A save's blocks in registered staging: `n` blocks of `heads` payloads, then the digest
    slots; `staged` waits for a CUDA cache's copy down. A zero-copy save's blocks are in device
    staging instead (`units` on the device, no digest slots, no extent)."""

    __slots__ = (
        "__weakref__",
        "_give",
        "digested",
        "digests",
        "n",
        "offset",
        "on_device",
        "reserving",
        "size",
        "staged",
        "units",
    )

    def __init__(
        self,
        offset: int,
        size: int,
        units: torch.Tensor,
        digests: torch.Tensor,
        staged: StagedSave | None,
        *,
        on_device: bool = False,
    ) -> None:
        self.offset, self.size = offset, size
        self.units, self.digests, self.staged = units, digests, staged
        self.on_device = on_device
        self.n = int(units.shape[0])
        self._give: weakref.finalize[..., object] | None = None
        self.reserving: Reserving | None = None
        """A grouped zero-copy save's reservations, asked for before the gather ran."""
        self.digested: torch.cuda.Event | None = None
        """A captured gather's: its digests (`digests`, per group) are in once this is."""

    def wait(self) -> None:
        if self.staged is not None:
            self.staged.wait()

    def release(self) -> None:
        """Give the extent back once any copy into it is done (at most once)."""
        self.wait()
        if self._give is not None:
            self._give()


@dataclass(slots=True)
class ZeroCopyCounts:
    """What the zero-copy path did: objects moved directly and through the store's own
    calls, and the seconds the last save and load spent in master round trips."""

    saved_direct: int = 0
    saved_through_store: int = 0
    loaded_direct: int = 0
    loaded_through_store: int = 0
    last_save_store_s: float = 0.0
    last_load_store_s: float = 0.0


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
        zero_copy: bool | None = None,
        chunk_objects: int = CHUNK_OBJECTS,
        first_chunk_objects: int = FIRST_CHUNK_OBJECTS,
        rpc_threads: int = RPC_THREADS,
    ) -> None:
        self.client = client
        self.kv = kv
        self.local = local
        pinned = isinstance(kv, CudaPagedKV) and kv.device.type == "cuda"
        self._unit = kv.payload_nbytes
        self._heads = kv.num_kv_heads
        if chunk_objects < 1:
            raise ValueError("chunk_objects must be >= 1")
        self.chunk_objects = chunk_objects
        self.first_chunk_objects = first_chunk_objects
        """A grouped save's or load's first chunk (then twice the last, up to `chunk_objects`):
        small, so the first copy starts after the shortest round trips."""
        can = (
            isinstance(kv, CudaPagedKV)
            and client.settings.segment_bytes > 0
            and self._unit % 8 == 0
            and (kv.device.type != "cuda" or cuda_runtime() is not None)
        )
        if zero_copy and not can:
            raise ValueError(
                "zero copy needs a CudaPagedKV, a store client with its own segment and payloads "
                "of a multiple of 8 bytes (and the CUDA runtime on a device)"
            )
        self.zero_copy = (can and pinned) if zero_copy is None else zero_copy
        """Saves and loads copy between the device and the store's memory directly."""
        self.save_slots = True
        """A grouped zero-copy save gathers and digests in one `SaveSlot` (False: launch by
        launch, the digests in `put_groups`: the path measured before, kept to compare)."""
        self.graphs = True
        """A grouped zero-copy save's gather and digests, and a grouped load's checks and gated
        scatter, replay CUDA graphs captured per shape (`SaveSlot`, `LoadSlot`)."""
        self._save_slots: Slots[SaveSlot] = Slots(self._make_save_slot)
        self._load_slots: Slots[LoadSlot] = Slots(self._make_load_slot, per_key=1)
        self.gated_load = True
        """A grouped zero-copy load checks and scatters with no host wait until its end
        (`_load_groups_gated`); False: chunk by chunk, the host reading each chunk's flags
        (`_load_groups_device`)."""
        self.counts = ZeroCopyCounts()
        self._segments = (
            HostSegments(kv.device) if self.zero_copy and isinstance(kv, CudaPagedKV) else None
        )
        self._copies: torch.cuda.Stream | None = None
        """A grouped zero-copy save's or load's copies (the kernels stay on the connector's
        stream, so a chunk's framing or check runs while another chunk's copy does)."""
        if self.zero_copy and isinstance(kv, CudaPagedKV) and kv.stream is not None:
            self._copies = torch.cuda.Stream(kv.device)
        self._device_lock = threading.Lock()
        self._resolving: dict[str, Future[list[Replica | None]]] = {}
        """Lookups `resolve` asked for, by key, until a load takes them."""
        self._device_bytes = 0  # device staging held by zero-copy saves not yet put
        self._device_budget = staging_bytes
        if rpc_threads < 1:
            raise ValueError("rpc_threads must be >= 1")
        self._rpc = ThreadPoolExecutor(rpc_threads, thread_name_prefix="store-rpc")
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

    def gather(
        self,
        block_ids: Sequence[int],
        *,
        groups: Sequence[ObjectGroup] | None = None,
        reserving: Reserving | None = None,
    ) -> StagedStore | None:
        """Copy blocks out of the cache into save staging (one gather; a CUDA cache's copy down
        goes on after this returns); None when the staging has no room (drop the save). With
        `groups` (a grouped save's objects, what `put_groups` will be given) a zero-copy save
        asks the master for their room once the gather is queued, so the round trips run
        while the kernels do; `reserving` (`reserve` / `reserve_groups`, asked for when the
        step's blocks were known, before the forward pass) is used instead, so the save finds
        its addresses in. A save that does not go zero copy gives `reserving` back."""
        if groups is not None:
            self._check_groups(groups, len(block_ids))
        if self.zero_copy:
            on_device = self._gather_device(block_ids, groups, reserving)
            if on_device is not None:
                return on_device
        if reserving is not None:  # the store's own put writes these keys: no room held
            reserving.cancel(self.client)
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

    def _gather_device(
        self,
        block_ids: Sequence[int],
        groups: Sequence[ObjectGroup] | None,
        reserving: Reserving | None = None,
    ) -> StagedStore | None:
        """The blocks in device staging, or None when zero-copy saves in flight already hold
        `staging_bytes` of it (the save then goes through host staging)."""
        assert isinstance(self.kv, CudaPagedKV)
        nbytes = len(block_ids) * self._heads * self._unit
        with self._device_lock:
            if self._device_bytes + nbytes > self._device_budget:
                return None
            self._device_bytes += nbytes
        if groups and self.save_slots:
            slot_key = (len(block_ids), tuple(g.count for g in groups), self.graphs)
            slot = self._save_slots.take(slot_key)
            if slot is not None:
                return self._gather_slot(block_ids, groups, slot_key, slot, nbytes, reserving)
        try:
            units = self.kv.device_gather(block_ids)
        except BaseException:
            self._give_device(nbytes)
            if reserving is not None:
                reserving.cancel(self.client)
            raise
        # asked for once the kernel is queued: its launch does not wait for the RPC threads
        if reserving is None and groups:
            reserving = self.reserve_groups(groups)
        out = StagedStore(-1, 0, units, units.new_empty(0), None, on_device=True)
        out._give = weakref.finalize(out, self._give_device, nbytes)
        if reserving is not None:
            out.reserving = reserving
            weakref.finalize(out, reserving.cancel, self.client)  # dropped before its put
        return out

    def _gather_slot(
        self,
        block_ids: Sequence[int],
        groups: Sequence[ObjectGroup],
        key: tuple[int, tuple[int, ...], bool],
        slot: SaveSlot,
        nbytes: int,
        reserving: Reserving | None = None,
    ) -> StagedStore:
        """A grouped save's gather and digests as one replay of `slot`'s launches (ids and key
        terms uploaded first), then its reservations asked for (unless `reserving` holds
        them)."""
        kv = self.kv
        assert isinstance(kv, CudaPagedKV)
        try:
            ids = kv._checked_ids(block_ids, distinct=False)
            n = len(ids)
            host = slot.host.numpy()
            if slot.done is not None:
                slot.done.synchronize()  # the last replay's upload has read `host`
            host[:n] = ids
            lanes = None if reserving is None else reserving.lanes
            if lanes is None or reserving is None or reserving.keys != [g.key for g in groups]:
                lanes = self._lanes(groups, [g.key for g in groups], self._heads)
            host[n:] = lanes.reshape(-1)
            stream = kv.stream
            if stream is None:
                slot.launches.run()
            else:
                engine = torch.cuda.current_stream(kv.device)
                with _Current(stream):
                    stream.wait_stream(engine)  # this step's KV writes are in before the gather
                    slot.launches.run()  # the upload, the gather and the digests
                    if slot.done is None:
                        slot.done = torch.cuda.Event()
                    slot.done.record(stream)
                    engine.wait_event(slot.done)  # the blocks may be reused once read
        except BaseException:
            self._save_slots.give(key, slot)
            self._give_device(nbytes)
            if reserving is not None:
                reserving.cancel(self.client)
            raise
        if reserving is None:
            reserving = self.reserve_groups(groups)  # once the replay is queued
        out = StagedStore(-1, 0, slot.staging, slot.digests, None, on_device=True)
        out.digested = slot.done if stream is not None else None

        def give() -> None:
            self._give_device(nbytes)
            self._save_slots.give(key, slot)

        out._give = weakref.finalize(out, give)
        out.reserving = reserving
        weakref.finalize(out, reserving.cancel, self.client)  # dropped before its put
        return out

    def _lanes(self, groups: Sequence[ObjectGroup], keys: list[str], heads: int) -> np.ndarray:
        """The key terms of each group's digest (`key_lanes` of its payload size), `[m, 2]`
        int64 bits."""
        parts = [
            key_lanes(keys[a:b], width).view(np.int64)
            for a, b, width in self._widths(groups, heads)
        ]
        return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)

    def _widths(self, groups: Sequence[ObjectGroup], heads: int) -> Iterator[tuple[int, int, int]]:
        """(first, end, payload bytes) of each run of consecutive groups of one block count."""
        a, m = 0, len(groups)
        while a < m:
            b = a + 1
            while b < m and groups[b].count == groups[a].count:
                b += 1
            yield a, b, groups[a].count * heads * self._unit
            a = b

    def _make_save_slot(self, key: Hashable) -> SaveSlot:
        n, counts, graphs = cast(tuple[int, tuple[int, ...], bool], key)
        kv = self.kv
        assert isinstance(kv, CudaPagedKV)
        h, unit, m, dev = self._heads, self._unit, len(counts), kv.device
        groups = _groups_of(counts)
        staging = torch.empty((n, h, unit), dtype=torch.uint8, device=dev)
        digests = torch.empty((m, CHECKSUM_BYTES), dtype=torch.uint8, device=dev)
        host = torch.empty(n + 2 * m, dtype=torch.int64, pin_memory=dev.type == "cuda")
        up = torch.empty(n + 2 * m, dtype=torch.int64, device=dev)
        ids, lanes = up[:n], up[n:].view(m, 2)
        shape = kv.paged.geometry.head_buffer_shape(n, block_major=True)
        typed = staging.view(-1).view(kv.dtype).view(shape)
        flat = staging.view(-1)

        def launches() -> None:
            up.copy_(host, non_blocking=True)
            split_heads(kv.paged, ids, typed, block_major=True)
            for a, b, _width, rows in self._size_runs(flat, groups, h):
                gpu_digest.digests(rows, lanes[a:b], digests[a:b])

        return SaveSlot(staging, digests, host, up, Captured(launches, dev, capture=bool(graphs)))

    def reserve_groups(self, groups: Sequence[ObjectGroup]) -> Reserving:
        """The reservations of a grouped save's objects (`put_groups`' keys and sizes), chunk by
        chunk, submitted to the RPC threads (`reserve`)."""
        keys = [g.key for g in groups]
        sizes = [self._object_bytes(g.count) for g in groups]
        bounds = chunk_bounds(len(keys), self.first_chunk_objects, self.chunk_objects)
        reserving = self.reserve(keys, sizes, bounds)
        if self.zero_copy and self.save_slots:  # the slot's gather uploads them
            reserving.lanes = self._lanes(groups, keys, self._heads)
        return reserving

    def reserve(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        bounds: Sequence[tuple[int, int]] | None = None,
    ) -> Reserving:
        """Submit the reservations of a save's objects (`keys`, `sizes` with their digests, as
        the save will write them) to the RPC threads now, chunk by chunk (`bounds`; default
        `chunk_objects` a chunk): asked for as soon as a step's blocks to save are known (the
        worker binding the step's metadata, before the forward pass), the master's round trips
        are over when the gather is, and the save's copies start at once. Hand it to `gather`;
        `Reserving.cancel` when the save is dropped before."""
        keys, sizes = list(keys), [int(n) for n in sizes]
        if len(keys) != len(sizes):
            raise ValueError(f"{len(sizes)} sizes for {len(keys)} keys")
        if bounds is None:
            c = self.chunk_objects
            bounds = [(a, min(len(keys), a + c)) for a in range(0, len(keys), c)]
        futures = [
            self._rpc.submit(self.client.reserve_local, keys[a:b], sizes[a:b]) for a, b in bounds
        ]
        return Reserving(keys, sizes, list(bounds), futures)

    def reserve_rows(self, rows: Sequence[Sequence[tuple[int, str]]]) -> Reserving:
        """`reserve` of a per-head save's objects (`put`'s `rows`, in its order)."""
        keys = [key for row in rows for _j, key in row]
        return self.reserve(keys, [self._unit + CHECKSUM_BYTES] * len(keys))

    def resolve(self, keys: Sequence[str]) -> None:
        """Look up where a coming load's objects are (`StoreClient.local_replicas`, cached) on
        an RPC thread now: asked for when the hit is decided (the worker binding the step's
        metadata, a step before the load runs), the load finds the answers in the client's
        replica cache with no master round trip in its way. An address gone stale by then (the
        object removed, evicted, its memory reused) fails the object's keyed digest on the
        device and is read afresh through the store, as any cached replica. A no-op without
        the replica cache (`replica_cache_s` 0) or off the zero-copy path."""
        if not self.zero_copy or self.client.settings.replica_cache_s <= 0 or not keys:
            return
        keys = list(keys)
        future = self._rpc.submit(self.client.local_replicas, keys, cached=True)
        with self._device_lock:
            for key in keys:
                self._resolving.pop(key, None)
                self._resolving[key] = future
            while len(self._resolving) > RESOLVING_KEYS:  # loads never run: oldest first
                del self._resolving[next(iter(self._resolving))]

    def _lookups(
        self, keys: list[str], bounds: Sequence[tuple[int, int]]
    ) -> tuple[list[Future[list[Replica | None]]], float]:
        """A zero-copy load's replica lookups, one future per chunk of `bounds`, and the
        seconds waited for lookups `resolve` asked for earlier: every key resolved, the
        chunks are answered from the replica cache here (no round trip, no thread hop); else
        submitted to the RPC threads (cached) as they come."""
        with self._device_lock:
            early = [self._resolving.pop(k, None) for k in keys]
        waited = 0.0
        if early and all(f is not None for f in early):
            t0 = time.perf_counter()
            for f in {id(f): f for f in early if f is not None}.values():
                with contextlib.suppress(Exception):
                    f.result()
            waited = time.perf_counter() - t0
            found = self.client.local_replicas(keys, cached=True)  # one pass over the cache
            out: list[Future[list[Replica | None]]] = []
            for a, b in bounds:
                done: Future[list[Replica | None]] = Future()
                done.set_result(found[a:b])
                out.append(done)
            return out, waited
        futures = [
            self._rpc.submit(self.client.local_replicas, keys[a:b], cached=True) for a, b in bounds
        ]
        return futures, waited

    def _object_bytes(self, count: int, heads: int | None = None) -> int:
        """Bytes of a grouped object of `count` blocks (`heads` each, default this rank's), its
        digest included."""
        return count * (self._heads if heads is None else heads) * self._unit + CHECKSUM_BYTES

    @staticmethod
    def _check_groups(groups: Sequence[ObjectGroup], n: int) -> None:
        at = 0
        for g in groups:
            if g.first != at or g.count < 1:
                raise ValueError("object groups must cover the blocks in order, each non-empty")
            at += g.count
        if at != n:
            raise ValueError(f"object groups cover {at} blocks of {n}")

    def _give_device(self, nbytes: int) -> None:
        with self._device_lock:
            self._device_bytes -= nbytes

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        """The cache's device and its connector stream, current (nothing on CPU tensors)."""
        kv = self.kv
        if not isinstance(kv, CudaPagedKV) or kv.stream is None:
            return contextlib.nullcontext()
        return _Current(kv.stream)

    def _sync(self) -> None:
        kv = self.kv
        if isinstance(kv, CudaPagedKV) and kv.stream is not None:
            kv.stream.synchronize()
        if self._copies is not None:
            self._copies.synchronize()

    def _copying(self) -> contextlib.AbstractContextManager[object]:
        """The copy stream, current (nothing on CPU tensors)."""
        if self._copies is None:
            return contextlib.nullcontext()
        return _Current(self._copies)

    def _mark(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream (None on CPU tensors: work there is done)."""
        if self._copies is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @staticmethod
    def _after(event: torch.cuda.Event | None) -> None:
        """The current stream waits for `event`."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def put(self, staged: StagedStore, rows: Sequence[Sequence[tuple[int, str]]]) -> SaveOutcome:
        """Store `rows[i]` ((local head, key) pairs) of block `i` of `staged` in one batch put.
        `StoreUnavailable` / `StoreFull` / `StoreError` when the store took none."""
        try:
            return self._put(staged, rows)
        finally:
            if staged.reserving is not None and not staged.reserving.taken:
                staged.reserving.cancel(self.client)
            staged.release()

    def _put(self, staged: StagedStore, rows: Sequence[Sequence[tuple[int, str]]]) -> SaveOutcome:
        if len(rows) != staged.n:
            raise ValueError(f"{len(rows)} key rows for {staged.n} staged blocks")
        if staged.on_device:
            return self._put_device(staged, rows)
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

    def _put_device(
        self, staged: StagedStore, rows: Sequence[Sequence[tuple[int, str]]]
    ) -> SaveOutcome:
        """A zero-copy save (see the module docstring)."""
        assert isinstance(self.kv, CudaPagedKV) and self._segments is not None
        h, unit = self._heads, self._unit
        size = unit + CHECKSUM_BYTES
        keys: list[str] = []
        index: list[int] = []
        for i, row in enumerate(rows):
            for j, key in row:
                keys.append(key)
                index.append(i * h + j)
        if not keys:
            return SaveOutcome([], [])
        m, dev = len(keys), self.kv.device
        flat = staged.units.view(-1, unit)
        done: list[bool] = [False] * m  # stored (written here, put, or already there)
        reserved: list[str] = []  # reserved here and not yet written
        with self._on_stream():
            if index != list(range(flat.shape[0])):
                flat = flat.index_select(0, torch.tensor(index).to(dev, non_blocking=True))
            objects = torch.empty((m, size), dtype=torch.uint8, device=dev)
            gpu_digest.frame(flat, gpu_digest.keys_tensor(keys, unit, dev), objects)
            digests = objects[:, unit:]
            if dev.type == "cuda":
                digests = torch.empty((m, CHECKSUM_BYTES), dtype=torch.uint8, pin_memory=True)
                digests.copy_(objects[:, unit:], non_blocking=True)
            through: list[int] = []  # not reserved here: put through the store
            store_s = 0.0
            written = 0
            early = staged.reserving
            if early is not None and early.keys == keys and early.sizes == [size] * m:
                early.taken = True  # reserved when the step was bound
                starts = [a for a, _b in early.bounds]
                pending = early.futures
            else:
                if early is not None:
                    early.cancel(self.client)
                starts = list(range(0, m, self.chunk_objects))
                pending = [
                    self._rpc.submit(
                        self.client.reserve_local, keys[a : a + self.chunk_objects], size
                    )
                    for a in starts
                ]
            try:
                for a, future in zip(starts, pending, strict=True):
                    t0 = time.perf_counter()
                    got = future.result()
                    store_s += time.perf_counter() - t0
                    at: list[int] = []
                    addresses: list[int] = []
                    for i, r in enumerate(got, a):
                        if isinstance(r, Replica) and r.size == size:
                            at.append(i)
                            addresses.append(r.address)
                            reserved.append(keys[i])
                        elif r == EXISTS:
                            done[i] = True
                        else:
                            through.append(i)
                    unusable: list[str] = []
                    for run in strided_runs(at, addresses, size):
                        rows_at = at[run.first : run.first + run.count]
                        lo, span = addresses[run.first], run.pitch * (run.count - 1) + size
                        if not self._segments.ready(lo, span):  # the device cannot reach it
                            unusable += [keys[i] for i in rows_at]
                            through += rows_at
                            continue
                        copy_rows(
                            lo, run.pitch, int(objects[rows_at[0]].data_ptr()), size,
                            size, run.count, dev,
                        )  # fmt: skip
                        for i in rows_at:
                            done[i] = True
                        written += run.count
                    if unusable:  # reserved here but not written: gone before anyone is told
                        self.client.remove(unusable)
                        reserved = [k for k in reserved if k not in set(unusable)]
                self._sync()
                reserved.clear()
            finally:
                if reserved or not all(f.done() for f in pending):
                    # a failure midway: what was reserved may never be written
                    for a, future in zip(starts, pending, strict=True):
                        with contextlib.suppress(Exception):
                            got = future.result()
                            mine = zip(keys[a : a + len(got)], got, strict=True)
                            reserved += [k for k, r in mine if isinstance(r, Replica)]
                    self._sync()
                    with contextlib.suppress(StoreError):
                        self.client.remove(sorted(set(reserved)))
            self.counts.last_save_store_s = store_s
            self.counts.saved_direct += written
            if through:
                codes = self._put_through(keys, objects, through, any(done))
                for i, code in zip(through, codes, strict=True):
                    done[i] = code == 0
                self.counts.saved_through_store += len(through)
        view = digests.numpy()
        stored = [(k, unit, view[i].tobytes()) for i, k in enumerate(keys) if done[i]]
        return SaveOutcome(stored, [k for i, k in enumerate(keys) if not done[i]])

    def _put_through(
        self, keys: list[str], objects: torch.Tensor, which: list[int], some_stored: bool
    ) -> list[int]:
        """`put_objects` of the framed objects `which` from registered staging (objects the
        store placed outside this client's segment); per key its code. The store's errors
        pass on unless `some_stored` (then these keys are refused, the rest reported)."""
        size = int(objects.shape[1])
        got = self._saves.take(len(which) * size)
        if got is None:
            return [-1] * len(which)
        offset, extent = got
        try:
            rows = extent.view(len(which), size)
            picked = objects.index_select(0, torch.tensor(which).to(objects.device))
            rows.copy_(picked, non_blocking=True)
            self._sync()
            base = int(rows.data_ptr())
            try:
                return self.client.put_objects(
                    [keys[i] for i in which],
                    [base + k * size for k in range(len(which))],
                    [size] * len(which),
                    local=self.local,
                )
            except StoreError:
                if not some_stored:
                    raise
                return [-1] * len(which)
        finally:
            self._saves.give(offset, len(which) * size)

    # --- the grouped layout: one object per group of blocks, every head -------------------------

    def put_groups(self, staged: StagedStore, groups: Sequence[ObjectGroup]) -> SaveOutcome:
        """Store `staged`'s blocks as the grouped layout's objects (`plan.object_groups`): group
        `g` holds blocks `[g.first, g.first + g.count)` with every head this rank holds (their
        keys must say as many: `plan.group_key`'s `heads`), one digest after them. Zero copy
        where `gather` put the blocks on the device, else one `put_split` from host staging.
        Errors as `put`."""
        try:
            self._check_groups(groups, staged.n)
            if not groups:
                return SaveOutcome([], [])
            if staged.on_device:
                return self._put_groups_device(staged, groups)
            staged.wait()
            h, unit = self._heads, self._unit
            base, dbase = int(staged.units.data_ptr()), int(staged.digests.data_ptr())
            keys = [g.key for g in groups]
            sizes = [g.count * h * unit for g in groups]
            codes = self.client.put_split(
                keys,
                [base + g.first * h * unit for g in groups],
                sizes,
                [dbase + i * CHECKSUM_BYTES for i in range(len(groups))],
                local=self.local,
            )
            view = staged.digests.numpy()
            stored = [
                (k, n, view[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES].tobytes())
                for i, (k, n, c) in enumerate(zip(keys, sizes, codes, strict=True))
                if c == 0
            ]
            refused = [k for k, c in zip(keys, codes, strict=True) if c != 0]
            return SaveOutcome(stored, refused)
        finally:
            if staged.reserving is not None and not staged.reserving.taken:
                staged.reserving.cancel(self.client)
            staged.release()

    def _size_runs(
        self, flat: torch.Tensor, groups: Sequence[ObjectGroup], heads: int
    ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """The runs of consecutive groups of one block count, each served by one launch pair:
        (first group, end, a group's payload bytes, the `[end - first, width]` view of their
        payloads in `flat`, the `[n, heads, unit]` staging flat)."""
        a, m = 0, len(groups)
        while a < m:
            b = a + 1
            while b < m and groups[b].count == groups[a].count:
                b += 1
            width = groups[a].count * heads * self._unit
            lo = groups[a].first * heads * self._unit
            yield a, b, width, flat[lo : lo + (b - a) * width].view(b - a, width)
            a = b

    def _frame_groups(
        self,
        payloads: torch.Tensor,
        groups: Sequence[ObjectGroup],
        keys: list[str],
        heads: int,
        objects: torch.Tensor,
        offsets: list[int],
        *,
        check: bool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Frame (save: `payloads` -> `objects`) or check and unframe (load: `objects` ->
        `payloads`, a flag per group, written into `out` when given) every group, one launch
        pair per run of groups of one size; `payloads` is `[n, heads, unit]` flat, `objects`
        holds object g at `offsets[g]`."""
        dev = objects.device
        flags: list[torch.Tensor] = []
        for a, b, width, rows in self._size_runs(payloads.reshape(-1), groups, heads):
            objs = objects[offsets[a] : offsets[b]].view(b - a, width + CHECKSUM_BYTES)
            lanes = gpu_digest.keys_tensor(keys[a:b], width, dev)
            if check:
                ok = None if out is None else out[a:b]
                flags.append(gpu_digest.unframe(objs, lanes, rows, ok))
            else:
                gpu_digest.frame(rows, lanes, objs)
        if out is not None:
            return out
        return torch.cat(flags) if flags else objects.new_empty(0, dtype=torch.int32)

    def _put_groups_device(self, staged: StagedStore, groups: Sequence[ObjectGroup]) -> SaveOutcome:
        """A grouped zero-copy save: reservations (asked for at `gather` when it had the
        groups); each object's payload copied from the gather's staging straight into the
        store's memory on the copy stream, chunk by chunk as the reservations come in, while
        the digests are computed on the connector's stream; then each digest after its
        payload."""
        assert isinstance(self.kv, CudaPagedKV) and self._segments is not None
        h, unit, dev = self._heads, self._unit, self.kv.device
        keys = [g.key for g in groups]
        sizes = [self._object_bytes(g.count) for g in groups]
        m = len(groups)
        reserving = staged.reserving
        if reserving is None or reserving.keys != keys or reserving.sizes != sizes:
            if reserving is not None:
                reserving.cancel(self.client)
            reserving = self.reserve_groups(groups)
        reserving.taken = True
        done = [False] * m
        reserved: list[str] = []  # reserved here and not yet written
        through: list[int] = []
        store_s = 0.0
        written = 0
        flat = staged.units.reshape(-1)
        in_replay = staged.digested is not None  # the slot's replay computed the digests
        cs = None if self._copies is None else self._copies.cuda_stream
        with self._on_stream():
            # the gather's staging is in: the replay's event, or one marked after it here
            gathered = staged.digested if in_replay else self._mark()
            if staged.digests.numel() == m * CHECKSUM_BYTES:
                digests = staged.digests  # computed with the gather, in its replay
            else:
                digests = torch.empty((m, CHECKSUM_BYTES), dtype=torch.uint8, device=dev)
                self._digest_groups(flat, groups, keys, h, digests, check=False)
            digested = None if in_replay else self._mark()
            base, dbase = int(flat.data_ptr()), int(digests.data_ptr())
            written_at: dict[int, int] = {}  # object -> its address in the store's memory
            try:
                for (a, _b), future in zip(reserving.bounds, reserving.futures, strict=True):
                    t0 = time.perf_counter()
                    got = future.result()
                    store_s += time.perf_counter() - t0
                    unusable: list[str] = []
                    with self._copying():
                        if gathered is not None:  # once: the copy stream is in order after it
                            self._after(gathered)
                            gathered = None
                        for i, r in enumerate(got, a):
                            if isinstance(r, Replica) and r.size == sizes[i]:
                                reserved.append(keys[i])
                                if not self._segments.ready(r.address, sizes[i]):
                                    unusable.append(keys[i])
                                    through.append(i)
                                    continue
                                width = sizes[i] - CHECKSUM_BYTES
                                src = base + groups[i].first * h * unit
                                copy_rows(r.address, width, src, width, width, 1, dev, cs)
                                if in_replay:  # in already: right after it
                                    d = CHECKSUM_BYTES
                                    src = dbase + i * d
                                    copy_rows(r.address + width, d, src, d, d, 1, dev, cs)
                                written_at[i] = r.address
                                done[i] = True
                                written += 1
                            elif r == EXISTS:
                                done[i] = True
                            else:
                                through.append(i)
                    if unusable:  # reserved here but not written: gone before anyone is told
                        self.client.remove(unusable)
                        reserved = [k for k in reserved if k not in set(unusable)]
                if not in_replay:
                    with self._copying():  # each digest after its payload, once computed
                        self._after(digested)
                        for i, address in written_at.items():
                            at = address + sizes[i] - CHECKSUM_BYTES
                            src = dbase + i * CHECKSUM_BYTES
                            d = CHECKSUM_BYTES
                            copy_rows(at, d, src, d, d, 1, dev, cs)
                self._sync()
                reserved.clear()
            finally:
                if reserved or not all(f.done() for f in reserving.futures):
                    for (a, b), future in zip(reserving.bounds, reserving.futures, strict=True):
                        with contextlib.suppress(Exception):
                            got = future.result()
                            mine = zip(keys[a:b], got, strict=True)
                            reserved += [k for k, r in mine if isinstance(r, Replica)]
                    self._sync()
                    with contextlib.suppress(StoreError):
                        self.client.remove(sorted(set(reserved)))
        self.counts.last_save_store_s = store_s
        self.counts.saved_direct += written
        if through:
            codes = self._put_through_groups(keys, groups, flat, digests, through, any(done))
            for i, code in zip(through, codes, strict=True):
                done[i] = code == 0
            self.counts.saved_through_store += len(through)
        # the digests as the store holds them (read where the copies put them; the others from
        # the device: the same bytes, the digest being keyed)
        stored = []
        for i, k in enumerate(keys):
            if not done[i]:
                continue
            if i in written_at:
                at = written_at[i] + sizes[i] - CHECKSUM_BYTES
                digest = ctypes.string_at(at, CHECKSUM_BYTES)
            else:
                digest = digests[i].cpu().numpy().tobytes()
            stored.append((k, sizes[i] - CHECKSUM_BYTES, digest))
        return SaveOutcome(stored, [k for i, k in enumerate(keys) if not done[i]])

    def _digest_groups(
        self,
        flat: torch.Tensor,
        groups: Sequence[ObjectGroup],
        keys: list[str],
        heads: int,
        digests: torch.Tensor,
        *,
        check: bool,
    ) -> torch.Tensor:
        """Each group's `KEYED_MAC` digest over its blocks in `flat` (`[n, heads, unit]`
        staging, flat) written into its row of `digests` (a save), or checked against it (a
        load: a flag per group); one launch pair per run of groups of one size."""
        flags: list[torch.Tensor] = []
        for a, b, width, rows in self._size_runs(flat, groups, heads):
            lanes = gpu_digest.keys_tensor(keys[a:b], width, flat.device)
            if check:
                flags.append(gpu_digest.check(rows, lanes, digests[a:b]))
            else:
                gpu_digest.digests(rows, lanes, digests[a:b])
        return torch.cat(flags) if flags else digests.new_empty(0, dtype=torch.int32)

    def _put_through_groups(
        self,
        keys: list[str],
        groups: Sequence[ObjectGroup],
        flat: torch.Tensor,
        digests: torch.Tensor,
        which: list[int],
        some_stored: bool,
    ) -> list[int]:
        """`put_objects` of the groups `which` (payload from `flat`, then its digest) from
        registered staging (objects the store placed outside this client's segment); as
        `_put_through`."""
        h, unit = self._heads, self._unit
        widths = [groups[i].count * h * unit for i in which]
        total = sum(widths) + len(which) * CHECKSUM_BYTES
        got = self._saves.take(total)
        if got is None:
            return [-1] * len(which)
        offset, extent = got
        try:
            at = 0
            addresses = []
            with self._on_stream():
                for i, width in zip(which, widths, strict=True):
                    lo = groups[i].first * h * unit
                    extent[at : at + width].copy_(flat[lo : lo + width], non_blocking=True)
                    extent[at + width : at + width + CHECKSUM_BYTES].copy_(
                        digests[i], non_blocking=True
                    )
                    addresses.append(int(extent.data_ptr()) + at)
                    at += width + CHECKSUM_BYTES
                self._sync()
            try:
                return self.client.put_objects(
                    [keys[i] for i in which],
                    addresses,
                    [w + CHECKSUM_BYTES for w in widths],
                    local=self.local,
                )
            except StoreError:
                if not some_stored:
                    raise
                return [-1] * len(which)
        finally:
            self._saves.give(offset, total)

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
        if self.zero_copy:
            return self._load_round_device(rows, block_ids)
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
            good, why, gone = self._settle(keys, codes)
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

    def _settle(self, keys: list[str], codes: Sequence[int]) -> tuple[int, str | None, list[str]]:
        """(blocks before the first key not read, why that one was not, keys found gone) of a
        round's per-key codes; a corrupted object is also removed from the store."""
        h = self._heads
        first = next((u for u, c in enumerate(codes) if c < 0), None)
        good = len(keys) // h if first is None else first // h
        why = None
        if first is not None:
            what = {MISSING: "missing", CORRUPTED: "corrupted"}.get(codes[first], "not read")
            why = f"{keys[first]}: {what} in Mooncake Store"
        gone = [k for k, c in zip(keys, codes, strict=True) if c in (MISSING, CORRUPTED)]
        corrupted = [k for k, c in zip(keys, codes, strict=True) if c == CORRUPTED]
        if corrupted:
            with contextlib.suppress(StoreError):  # the next reader removes it again
                self.client.remove(corrupted)
        return good, why, gone

    def _load_round_device(
        self, rows: Sequence[Sequence[str]], block_ids: Sequence[int]
    ) -> tuple[int, str | None, list[str]]:
        """A zero-copy load round (see the module docstring)."""
        assert isinstance(self.kv, CudaPagedKV) and self._segments is not None
        n, h, unit = len(rows), self._heads, self._unit
        size = unit + CHECKSUM_BYTES
        keys = [key for row in rows for key in row]
        m, dev = len(keys), self.kv.device
        copied = [False] * m
        store_s = 0.0
        with self._on_stream():
            lanes = gpu_digest.keys_tensor(keys, unit, dev)
            objects = torch.empty((m, size), dtype=torch.uint8, device=dev)
            payloads = torch.empty((n, h, unit), dtype=torch.uint8, device=dev)
            flat = payloads.view(m, unit)
            ok = torch.zeros(m, dtype=torch.int32, device=dev)
            starts = list(range(0, m, self.chunk_objects))
            pending, store_s = self._lookups(
                keys, [(a, min(m, a + self.chunk_objects)) for a in starts]
            )
            for a, future in zip(starts, pending, strict=True):
                t0 = time.perf_counter()
                found = future.result()
                store_s += time.perf_counter() - t0
                at: list[int] = []
                addresses: list[int] = []
                for i, r in enumerate(found, a):
                    if r is not None and r.size == size:
                        at.append(i)
                        addresses.append(r.address)
                for run in strided_runs(at, addresses, size):
                    rows_at = at[run.first : run.first + run.count]
                    lo, span = addresses[run.first], run.pitch * (run.count - 1) + size
                    if not self._segments.ready(lo, span):  # read through the store instead
                        continue
                    copy_rows(
                        int(objects[rows_at[0]].data_ptr()), size, lo, run.pitch,
                        size, run.count, dev,
                    )  # fmt: skip
                    for i in rows_at:
                        copied[i] = True
            if any(copied):
                ok = gpu_digest.unframe(objects, lanes, flat)
            verified = ok.cpu().tolist()  # waits for the copies and the checks
        codes, slow = self._tally_direct(keys, copied, verified, unit, store_s)
        why_store: str | None = None
        if slow:
            why_store = self._read_through(keys, slow, flat, codes)
        good, why, gone = self._settle(keys, codes)
        if why_store is not None and why is not None and UNREAD in codes:
            why = why_store
        if good:
            self.kv.device_scatter(payloads, block_ids[:good])
        return good, why, gone

    def _tally_direct(
        self,
        keys: list[str],
        copied: Sequence[object],
        verified: Sequence[object],
        unit: int,
        store_s: float,
    ) -> tuple[list[int], list[int]]:
        """A load's codes after its direct copies and checks: `unit` where an object was
        copied and verified, else UNREAD; the cached replicas of copied objects that failed
        their check are forgotten (another key's bytes, an XXH3 digest or a torn read: ask the
        master afresh), and the direct and through-the-store counts kept. Returns (codes, the
        objects still to read through the store)."""
        m = len(keys)
        codes = [unit if c and v else UNREAD for c, v in zip(copied, verified, strict=True)]
        stale = [keys[i] for i in range(m) if copied[i] and not verified[i]]
        if stale:
            self.client.forget_local(stale)
        slow = [i for i in range(m) if codes[i] < 0]
        self.counts.last_load_store_s = store_s
        self.counts.loaded_direct += m - len(slow)
        self.counts.loaded_through_store += len(slow)
        return codes, slow

    def _read_through(
        self, keys: list[str], which: list[int], flat: torch.Tensor, codes: list[int]
    ) -> str | None:
        """`get_split` of the keys `which` into registered staging, each verified on the CPU and
        copied up into its row of `flat`; their codes into `codes`. The store's error, if it
        failed (those keys then stay `UNREAD`: not reported gone)."""
        unit = self._unit
        nbytes = len(which) * (unit + CHECKSUM_BYTES)
        got = self._loads.take(nbytes)
        if got is None:  # the load thread is the region's only user: it is free between loads
            raise RuntimeError("load staging is in use")
        offset, extent = got
        try:
            base = int(extent.data_ptr())
            dbase = base + len(which) * unit
            try:
                read = self.client.get_split(
                    [keys[i] for i in which],
                    [base + k * unit for k in range(len(which))],
                    [unit] * len(which),
                    [dbase + k * CHECKSUM_BYTES for k in range(len(which))],
                )
            except StoreError as exc:
                return f"Mooncake Store: {exc}"
            slots = extent[: len(which) * unit].view(len(which), unit)
            with self._on_stream():
                for k, (i, code) in enumerate(zip(which, read, strict=True)):
                    codes[i] = code
                    if code >= 0:
                        flat[i].copy_(slots[k], non_blocking=True)
                self._sync()
            return None
        finally:
            self._loads.give(offset, nbytes)

    def load_groups(
        self,
        groups: Sequence[ObjectGroup],
        block_ids: Sequence[int],
        *,
        object_heads: int | None = None,
        first_head: int = 0,
    ) -> StoreLoadOutcome:
        """Read the grouped layout's objects `groups` (`plan.object_groups` of the blocks
        `block_ids` fill, `object_heads` heads each: default this rank's) and write their blocks
        into the cache: this rank's heads `[first_head, first_head + local heads)` of each (a
        TP-mismatched rank reads the whole object, verifies it and takes its heads). The first
        group missing or refused ends the good prefix, as `load`."""
        self._check_groups(groups, len(block_ids))
        heads = self._heads if object_heads is None else object_heads
        if first_head < 0 or first_head + self._heads > heads:
            raise ValueError(f"heads [{first_head}, {first_head + self._heads}) of {heads}")
        budget = self._loads.nbytes
        loaded = 0
        dropped: list[str] = []
        refused: str | None = None
        a = 0
        while a < len(groups):  # rounds of whole groups, each within the load staging
            b, nbytes = a, 0
            while b < len(groups) and (
                b == a or nbytes + self._object_bytes(groups[b].count, heads) <= budget
            ):
                nbytes += self._object_bytes(groups[b].count, heads)
                b += 1
            first = groups[a].first
            part = [ObjectGroup(g.key, g.first - first, g.count) for g in groups[a:b]]
            ids = block_ids[first : groups[b - 1].first + groups[b - 1].count]
            if self.zero_copy and self.gated_load:
                good, why, gone = self._load_groups_gated(part, ids, heads, first_head)
            elif self.zero_copy:
                good, why, gone = self._load_groups_device(part, ids, heads, first_head)
            else:
                good, why, gone = self._load_groups_host(part, ids, heads, first_head)
            loaded += good
            dropped.extend(gone)
            if why is not None:
                refused = why
                break
            a = b
        nbytes = loaded * self._heads * self._unit
        return StoreLoadOutcome(LoadOutcome(loaded, nbytes, refused), dropped)

    def _settle_groups(
        self, groups: Sequence[ObjectGroup], codes: Sequence[int]
    ) -> tuple[int, str | None, list[str]]:
        """(blocks before the first group not read, why, keys found gone) of per-group codes; a
        corrupted object is also removed from the store."""
        keys = [g.key for g in groups]
        first = next((i for i, c in enumerate(codes) if c < 0), None)
        good = sum(g.count for g in (groups if first is None else groups[:first]))
        why = None
        if first is not None:
            what = {MISSING: "missing", CORRUPTED: "corrupted"}.get(codes[first], "not read")
            why = f"{keys[first]}: {what} in Mooncake Store"
        gone = [k for k, c in zip(keys, codes, strict=True) if c in (MISSING, CORRUPTED)]
        corrupted = [k for k, c in zip(keys, codes, strict=True) if c == CORRUPTED]
        if corrupted:
            with contextlib.suppress(StoreError):
                self.client.remove(corrupted)
        return good, why, gone

    def _rank_units(self, units: torch.Tensor, lo: int, hi: int, first_head: int) -> torch.Tensor:
        """Blocks `[lo, hi)` of `[n, object heads, unit]` staging, this rank's heads."""
        if units.shape[1] == self._heads:
            return units[lo:hi]
        return units[lo:hi, first_head : first_head + self._heads]

    def _load_groups_host(
        self, groups: Sequence[ObjectGroup], block_ids: Sequence[int], heads: int, first_head: int
    ) -> tuple[int, str | None, list[str]]:
        """A grouped load round through the store's own calls (`get_split` into load staging)."""
        n, unit, m = len(block_ids), self._unit, len(groups)
        nbytes = n * heads * unit + m * CHECKSUM_BYTES
        got = self._loads.take(nbytes)
        if got is None:  # the load thread is the region's only user: it is free between loads
            raise RuntimeError("load staging is in use")
        offset, extent = got
        try:
            units = extent[: n * heads * unit].view(n, heads, unit)
            base = int(units.data_ptr())
            dbase = base + n * heads * unit
            try:
                codes = self.client.get_split(
                    [g.key for g in groups],
                    [base + g.first * heads * unit for g in groups],
                    [g.count * heads * unit for g in groups],
                    [dbase + i * CHECKSUM_BYTES for i in range(m)],
                )
            except StoreError as exc:
                return 0, f"Mooncake Store: {exc}", []
            good, why, gone = self._settle_groups(groups, codes)
            if good:
                mine = self._rank_units(units, 0, good, first_head)
                if isinstance(self.kv, CudaPagedKV):
                    self.kv.scatter_staged(LoadStaging(mine.contiguous()), block_ids[:good])
                else:
                    slots = mine.numpy()
                    payloads = [
                        [memoryview(slots[i, j]) for j in range(self._heads)] for i in range(good)
                    ]
                    self.kv.scatter_payloads(payloads, block_ids[:good])
            return good, why, gone
        finally:
            self._loads.give(offset, nbytes)

    def _load_groups_gated(
        self, groups: Sequence[ObjectGroup], block_ids: Sequence[int], heads: int, first_head: int
    ) -> tuple[int, str | None, list[str]]:
        """A grouped zero-copy load round with no host wait until its end: replicas looked up
        chunk by chunk (cached), each chunk's objects copied up on the copy stream into a
        `LoadSlot`'s buffers as soon as it is answered; once a part's objects are on their way
        (`part_ends`: each chunk, the last object alone), one replay checks and unframes them
        and scatters their blocks where the verified prefix allows (`merge_heads_gated`: the
        flags are read on the device), while the later objects are still copied. The host reads
        the flags once, when all of it is done;
        objects not read that way are read through the store and the rest of the good prefix
        scattered, as `_load_groups_device`."""
        assert isinstance(self.kv, CudaPagedKV) and self._segments is not None
        kv = self.kv
        n, m, dev = len(block_ids), len(groups), kv.device
        ids = kv._checked_ids(block_ids, distinct=True)
        keys = [g.key for g in groups]
        sizes = [self._object_bytes(g.count, heads) for g in groups]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        bounds = chunk_bounds(m, self.first_chunk_objects, self.chunk_objects)
        ends = part_ends(bounds, m)
        key = (n, tuple(g.count for g in groups), heads, first_head, ends, self.graphs)
        slot = self._load_slots.take(key)
        cached = slot is not None
        if slot is None:  # another load holds this shape's (none do: loads run one at a time)
            slot = self._make_load_slot(key, capture=False)
        copied = [False] * m
        store_s = 0.0
        try:
            with self._on_stream():
                host: np.ndarray | None = None  # written once the first copies are queued
                base = int(slot.objects.data_ptr())
                pending, store_s = self._lookups(keys, bounds)
                mask = slot.copied_host.numpy()
                part_of = {end: k for k, end in enumerate(ends)}
                copies = self._copies
                cs = None if copies is None else copies.cuda_stream
                for (a, _b), future in zip(bounds, pending, strict=True):
                    t0 = time.perf_counter()
                    found = future.result()
                    store_s += time.perf_counter() - t0
                    for i, r in enumerate(found, a):
                        if (
                            r is not None
                            and r.size == sizes[i]
                            and self._segments.ready(r.address, r.size)
                        ):  # else read through the store
                            copy_rows(
                                base + offsets[i], sizes[i], r.address, sizes[i], sizes[i],
                                1, dev, cs,
                            )  # fmt: skip
                            copied[i] = True
                        if host is None:  # the first copy is on its way: the replay's input
                            host = slot.host.numpy()  # (each block's group is in already)
                            host[:n] = ids
                            host[2 * n :] = self._lanes(groups, keys, heads).reshape(-1)
                        k = part_of.get(i + 1)
                        if k is not None:  # this part's objects are all on their way
                            lo = ends[k - 1] if k else 0
                            mask[lo : i + 1] = copied[lo : i + 1]
                            if copies is not None:
                                arrived = torch.cuda.Event()
                                arrived.record(copies)
                                self._after(arrived)
                            # the part's upload (the ids and key terms before the first part,
                            # its copied flags), checks and gated scatter: one replay
                            slot.parts[k].run()
                verified = slot.flags.cpu().tolist()  # waits for the copies, checks, scatters
            scattered = 0  # leading blocks the gated scatters wrote
            for i in range(m):
                if not (copied[i] and verified[i]):
                    break
                scattered = groups[i].first + groups[i].count
            codes, slow = self._tally_direct(keys, copied, verified, 1, store_s)
            why_store: str | None = None
            if slow:
                why_store = self._read_groups_through(groups, slow, slot.units, heads, codes)
            good, why, gone = self._settle_groups(groups, codes)
            if why_store is not None and why is not None and UNREAD in codes:
                why = why_store
            if good > scattered:
                kv.device_scatter(
                    self._rank_units(slot.units, scattered, good, first_head),
                    block_ids[scattered:good],
                )
            return good, why, gone
        finally:
            if cached:
                self._sync()
                self._load_slots.give(key, slot)

    def _make_load_slot(self, key: Hashable, *, capture: bool = True) -> LoadSlot:
        shape = cast(tuple[int, tuple[int, ...], int, int, tuple[int, ...], bool], key)
        n, counts, heads, first_head, ends, graphs = shape
        kv = self.kv
        assert isinstance(kv, CudaPagedKV)
        unit, m, dev = self._unit, len(counts), kv.device
        groups = _groups_of(counts)
        offsets = [0]
        for g in groups:
            offsets.append(offsets[-1] + self._object_bytes(g.count, heads))
        pinned = dev.type == "cuda"
        objects = torch.empty(offsets[-1], dtype=torch.uint8, device=dev)
        units = torch.empty((n, heads, unit), dtype=torch.uint8, device=dev)
        flags = torch.zeros(m, dtype=torch.int32, device=dev)
        host = torch.empty(2 * n + 2 * m, dtype=torch.int64, pin_memory=pinned)
        up = torch.empty(2 * n + 2 * m, dtype=torch.int64, device=dev)
        copied_host = torch.zeros(m, dtype=torch.int32, pin_memory=pinned)
        copied = torch.zeros(m, dtype=torch.int32, device=dev)
        ids, group_of, lanes = up[:n], up[n : 2 * n], up[2 * n :].view(m, 2)
        geometry = kv.paged.geometry
        per_block = (heads, geometry.num_layers, geometry.kv_factor, geometry.block_size)
        flat = units.view(-1)

        host.numpy()[n : 2 * n] = [k for k, g in enumerate(groups) for _ in range(g.count)]

        def part(lo: int, hi: int) -> None:
            if lo == 0:  # the ids, each block's group and the key terms
                up.copy_(host, non_blocking=True)
            if hi <= lo:
                return
            copied[lo:hi].copy_(copied_host[lo:hi], non_blocking=True)
            for a, b, width, rows in self._size_runs(flat, groups[lo:hi], heads):
                a, b = a + lo, b + lo
                objs = objects[offsets[a] : offsets[b]].view(b - a, width + CHECKSUM_BYTES)
                gpu_digest.unframe(objs, lanes[a:b], rows, flags[a:b])
            flags[lo:hi].mul_(copied[lo:hi])  # a slot's old bytes are not this load's
            first, end = groups[lo].first, groups[hi - 1].first + groups[hi - 1].count
            typed = units[first:end].reshape(-1).view(kv.dtype)
            typed = typed.view(end - first, *per_block, geometry.head_dim)
            merge_heads_gated(
                typed, kv.paged, ids[first:end], flags, group_of[first:end], first_head
            )

        use = capture and bool(graphs)
        return LoadSlot(
            objects,
            units,
            flags,
            host,
            up,
            copied_host,
            copied,
            [
                Captured(functools.partial(part, lo, hi), dev, capture=use)
                for lo, hi in zip((0, *ends[:-1]) if ends else (), ends, strict=True)
            ],
            ends,
        )

    def _load_groups_device(
        self, groups: Sequence[ObjectGroup], block_ids: Sequence[int], heads: int, first_head: int
    ) -> tuple[int, str | None, list[str]]:
        """A grouped zero-copy load round: replicas looked up chunk by chunk (cached), each
        chunk's objects copied up on the copy stream as soon as it is answered; then chunk by
        chunk on the connector's stream, each digest checked while the payloads are unframed
        and the chunk's blocks (this rank's heads) scattered while later chunks still come up.
        Objects not read that way are read through the store, and the good prefix is the
        first `good` blocks of every group before the first one refused."""
        assert isinstance(self.kv, CudaPagedKV) and self._segments is not None
        kv = self.kv
        n, unit, m, dev = len(block_ids), self._unit, len(groups), kv.device
        keys = [g.key for g in groups]
        sizes = [self._object_bytes(g.count, heads) for g in groups]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        copied = [False] * m
        verified = [0] * m
        store_s = 0.0
        scattered = 0  # leading blocks already written into the cache
        with self._on_stream():
            objects = torch.empty(offsets[-1], dtype=torch.uint8, device=dev)
            units = torch.empty((n, heads, unit), dtype=torch.uint8, device=dev)
            base = int(objects.data_ptr())
            bounds = chunk_bounds(m, self.first_chunk_objects, self.chunk_objects)
            pending, store_s = self._lookups(keys, bounds)
            arrived: list[torch.cuda.Event | None] = []
            for (a, _b), future in zip(bounds, pending, strict=True):
                t0 = time.perf_counter()
                found = future.result()
                store_s += time.perf_counter() - t0
                with self._copying():
                    for i, r in enumerate(found, a):
                        if r is None or r.size != sizes[i]:
                            continue  # read through the store instead
                        if not self._segments.ready(r.address, r.size):
                            continue
                        copy_rows(
                            base + offsets[i], sizes[i], r.address, sizes[i], sizes[i], 1, dev
                        )
                        copied[i] = True
                    arrived.append(self._mark())
            whole = True  # every group so far copied, verified and scattered
            for (a, b), event in zip(bounds, arrived, strict=True):
                if not any(copied[a:b]):
                    whole = False
                    continue
                self._after(event)
                ok = self._frame_groups(
                    units, groups[a:b], keys[a:b], heads, objects, offsets[a : b + 1], check=True
                )
                verified[a:b] = ok.cpu().tolist()  # waits for this chunk's copies and checks
                if not whole:
                    continue
                end = scattered
                for i in range(a, b):
                    if not (copied[i] and verified[i]):
                        whole = False
                        break
                    end = groups[i].first + groups[i].count
                if end > scattered:
                    kv.device_scatter(
                        self._rank_units(units, scattered, end, first_head),
                        block_ids[scattered:end],
                        wait=False,
                    )
                    scattered = end
            self._sync()
        codes, slow = self._tally_direct(keys, copied, verified, 1, store_s)
        why_store: str | None = None
        if slow:
            why_store = self._read_groups_through(groups, slow, units, heads, codes)
        good, why, gone = self._settle_groups(groups, codes)
        if why_store is not None and why is not None and UNREAD in codes:
            why = why_store
        if good > scattered:
            kv.device_scatter(
                self._rank_units(units, scattered, good, first_head), block_ids[scattered:good]
            )
        return good, why, gone

    def _read_groups_through(
        self,
        groups: Sequence[ObjectGroup],
        which: list[int],
        units: torch.Tensor,
        heads: int,
        codes: list[int],
    ) -> str | None:
        """`get_split` of the groups `which` into registered staging, each verified on the CPU
        and copied up into its blocks of `units`; codes into `codes` (as `_read_through`)."""
        unit = self._unit
        widths = [groups[i].count * heads * unit for i in which]
        nbytes = sum(widths) + len(which) * CHECKSUM_BYTES
        got = self._loads.take(nbytes)
        if got is None:
            raise RuntimeError("load staging is in use")
        offset, extent = got
        try:
            base = int(extent.data_ptr())
            starts = [0]
            for w in widths:
                starts.append(starts[-1] + w)
            dbase = base + starts[-1]
            try:
                read = self.client.get_split(
                    [groups[i].key for i in which],
                    [base + s for s in starts[:-1]],
                    widths,
                    [dbase + k * CHECKSUM_BYTES for k in range(len(which))],
                )
            except StoreError as exc:
                return f"Mooncake Store: {exc}"
            flat = units.view(-1)
            with self._on_stream():
                for k, (i, code) in enumerate(zip(which, read, strict=True)):
                    codes[i] = code
                    if code >= 0:
                        lo = groups[i].first * heads * unit
                        flat[lo : lo + widths[k]].copy_(
                            extent[starts[k] : starts[k + 1]], non_blocking=True
                        )
                self._sync()
            return None
        finally:
            self._loads.give(offset, nbytes)

    def close(self) -> None:
        """Unregister the staging and the store's memory (the client stays the caller's)."""
        self._rpc.shutdown(wait=True)
        if self._segments is not None:
            self._segments.close()
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
