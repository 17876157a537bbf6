"""vLLM's CUDA KV caches for the connector: a save's blocks leave the cache by one Triton launch
into a block-first staging buffer and reach pinned host memory on the connector's own CUDA
stream; a load assembles payloads in pinned memory, copies them up on that stream and scatters
them with one launch. Imports torch, numpy and `kernels` only (no vLLM), so it is tested with
plain tensors shaped like vLLM's.

**Layouts** (per layer, model layer order): FlashAttention `[2, num_blocks, block_size,
kv_heads, head_size]`, FlashInfer `[num_blocks, 2, block_size, kv_heads, head_size]` (either
stride order, NHD or HND), MLA `[num_blocks, block_size, latent_dim]` (kv_factor 1, one head).

**Staging**: `kernels.split_heads(..., block_major=True)`, `[n, kv_heads, layers, kv_factor,
block_size, head_size]`: block `i` is one contiguous run and its head `j` one contiguous
artifact payload, `[layers, kv_factor, block_size, head_size]` — the bytes `CpuAttnKV` produces
for the same KV, so artifacts stay portable across engines, devices and TP sizes. A payload
handed to the save thread is a read-only view into the pinned buffer (no host copy).

**Streams**: a save waits (on the device) for the engine's stream, so the step's KV writes are
in; the engine's stream waits (on the device) only for the gather kernel, so vLLM may reuse the
blocks at once while the device-to-host copy goes on; the save thread waits on the copy's event.
A load waits on its own event before it returns, so a finished load is in the cache. The
connector's load (`load.load_blocks`) reads the sidecar's answers straight into the pinned slots
of `load_staging` (`SidecarClient.get_many_into`) and writes them with `scatter_staged`; payloads
handed over as bytes (`scatter_payloads`) are first copied into pinned memory on the host (the
slow part: see `bench/RESULTS.md`).

The store path's zero copy takes the blocks from device staging itself (`device_gather`) and
writes them from device staging (`device_scatter`), on the same stream.

On CPU tensors the same class runs the kernels' reference path with no streams or pinning (the
tests' CPU half; vLLM's CPU backend uses `CpuAttnKV`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kernels import LayoutError, PagedKV, merge_heads, merge_heads_gated, split_heads, vllm_kv
from workers.vllm_connector.payload import Payload

# Host bytes per host<->device copy: a load assembles the next chunk while this one goes up; a
# save's payloads are ready chunk by chunk.
CHUNK_BYTES = 8 << 20
# Threads that copy payloads into the pinned buffer of a load (a single core's memcpy is slower
# than the PCIe link; bench/kernels/connector_staging.py measures).
COPY_THREADS = 4
# Pinned host bytes held by saves in flight (the save thread drains them) and loads; past it,
# staging falls back to ordinary memory, whose device copies the engine waits for.
MAX_PINNED_BYTES = 4 << 30


def paged_from_vllm(
    layers: Sequence[torch.Tensor], *, mla: bool = False, kv_dim: int | None = None
) -> PagedKV:
    """vLLM layer caches as `kernels` sees them; `kv_dim` (0 FlashAttention, 1 FlashInfer) is
    read off the shape when not given."""
    if not layers:
        raise LayoutError("no KV cache layers")
    if mla:
        return vllm_kv(layers, mla=True)
    if kv_dim is None:
        shape = tuple(layers[0].shape)
        if len(shape) != 5:
            raise LayoutError(f"expected a 5-D vLLM KV layer, got {shape}")
        if (shape[0] == 2) == (shape[1] == 2):
            raise LayoutError(f"cannot tell the K/V axis of {shape}: pass kv_dim")
        kv_dim = 0 if shape[0] == 2 else 1
    return vllm_kv(layers, kv_dim=kv_dim)


class StagedSave:
    """A save's blocks in host memory: `[n, local_heads, payload bytes]`, copied down in chunks of
    whole blocks, each with its event: `payload` waits for its own block's chunk only, so the save
    thread may send the first blocks while the last ones are still on their way."""

    __slots__ = ("_array", "_chunk_blocks", "_chunks", "_landed", "_timing", "_units")

    def __init__(
        self,
        units: torch.Tensor,
        chunks: Sequence[torch.cuda.Event] = (),
        chunk_blocks: int = 1,
        timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        self._units = units
        self._array = units.numpy()
        self._chunks = tuple(chunks)
        self._chunk_blocks = chunk_blocks
        self._landed = 0  # chunks known to be in host memory (they land in order)
        self._timing = timing

    @property
    def nbytes(self) -> int:
        return int(self._units.numel())

    def wait(self, index: int | None = None) -> None:
        """Block until block `index` (all blocks when None) is in host memory."""
        if not self._chunks:  # gathered on the CPU: already there
            return
        last = len(self._chunks) - 1 if index is None else index // self._chunk_blocks
        if last >= self._landed:
            self._chunks[last].synchronize()
            self._landed = last + 1

    def payload(self, local_head: int, index: int) -> memoryview:
        """The artifact of local head `local_head`, block `index`: a read-only view of the
        staging buffer (it keeps the buffer alive)."""
        self.wait(index)
        return memoryview(self._array[index, local_head]).toreadonly()

    def timings_ms(self) -> tuple[float, float]:
        """(gather kernel, device-to-host copy) milliseconds, for a cache built with
        `timing=True`."""
        if self._timing is None:
            raise RuntimeError("no timing events: build the cache with timing=True")
        self.wait()
        start, gathered = self._timing
        return start.elapsed_time(gathered), gathered.elapsed_time(self._chunks[-1])


class LoadStaging:
    """Pinned host staging of a load, `[n, local_heads, payload bytes]`: `slot(i, j)` is where the
    payload of block `i`, local head `j` goes."""

    __slots__ = ("_array", "units")

    def __init__(self, units: torch.Tensor) -> None:
        self.units = units
        self._array = units.numpy()

    @property
    def num_blocks(self) -> int:
        return int(self.units.shape[0])

    def slot(self, index: int, local_head: int) -> memoryview:
        """Writable view of the payload of block `index`, local head `local_head`."""
        return memoryview(self._array[index, local_head])


class CudaPagedKV:
    """vLLM layer caches on a CUDA device (or CPU tensors, for tests) behind the connector's
    `WorkerKV` interface; see the module docstring."""

    __slots__ = (
        "_chunk_bytes",
        "_copy_threads",
        "_engine_stream",
        "_lock",
        "_max_pinned",
        "_pinned",
        "_pool",
        "_stream",
        "_timing",
        "paged",
    )

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        *,
        mla: bool = False,
        kv_dim: int | None = None,
        copy_threads: int = COPY_THREADS,
        chunk_bytes: int = CHUNK_BYTES,
        max_pinned_bytes: int = MAX_PINNED_BYTES,
        engine_stream: torch.cuda.Stream | None = None,
        timing: bool = False,
    ) -> None:
        self.paged = paged_from_vllm(layers, mla=mla, kv_dim=kv_dim)
        if copy_threads < 1 or chunk_bytes < 1 or max_pinned_bytes < 0:
            raise ValueError("copy_threads and chunk_bytes must be >= 1, max_pinned_bytes >= 0")
        self._copy_threads = copy_threads
        self._chunk_bytes = chunk_bytes
        self._max_pinned = max_pinned_bytes
        self._pinned = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._timing = timing
        dev = self.paged.device
        self._stream: torch.cuda.Stream | None = None
        self._engine_stream: torch.cuda.Stream | None = None
        if dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)
            self._engine_stream = engine_stream or torch.cuda.current_stream(dev)

    # --- geometry (`WorkerKV`) ---------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.paged.geometry.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.paged.geometry.num_kv_heads

    @property
    def block_size(self) -> int:
        return self.paged.geometry.block_size

    @property
    def head_size(self) -> int:
        return self.paged.geometry.head_dim

    @property
    def kv_factor(self) -> int:
        return self.paged.geometry.kv_factor

    @property
    def dtype(self) -> torch.dtype:
        return self.paged.geometry.dtype

    @property
    def device(self) -> torch.device:
        return self.paged.device

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one (head, block) artifact: `[layers, kv_factor, block_size, head_size]`."""
        g = self.paged.geometry
        itemsize = torch.empty((), dtype=g.dtype).element_size()
        return g.num_layers * g.kv_factor * g.block_size * g.head_dim * itemsize

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes held by staging buffers now."""
        with self._lock:
            return self._pinned

    # --- save ----------------------------------------------------------------------------------

    def gather(self, block_ids: Sequence[int], host: torch.Tensor | None = None) -> StagedSave:
        """Copy blocks out of the cache: one kernel launch into device staging, then
        asynchronous copies to pinned memory, `chunk_bytes` of whole blocks each. Returns at
        once; the blocks may be reused by the engine's next work (its stream waits for the
        kernel). `host`: the uint8 `[n, heads, payload bytes]` buffer to land in (memory the
        caller registered with a store; pinned for an asynchronous copy), else one of ours."""
        ids = self._checked_ids(block_ids, distinct=False)
        n, h, unit = len(ids), self.num_kv_heads, self.payload_nbytes
        if host is not None and (
            tuple(host.shape) != (n, h, unit)
            or host.dtype != torch.uint8
            or not host.is_contiguous()
            or host.device.type != "cpu"
        ):
            raise LayoutError(f"host staging must be contiguous uint8 {(n, h, unit)} on the CPU")
        if self._stream is None:
            shape = self.paged.geometry.head_buffer_shape(n, block_major=True)
            out = None if host is None else host.view(self.dtype).view(shape)
            staging = split_heads(self.paged, ids, out, block_major=True)
            return StagedSave(staging.reshape(n, h, -1).view(torch.uint8))
        assert self._engine_stream is not None
        dev, stream = self.device, self._stream
        shape = self.paged.geometry.head_buffer_shape(n, block_major=True)
        with torch.cuda.device(dev):
            engine = torch.cuda.current_stream(dev)
            stream.wait_stream(engine)  # this step's KV writes are in before the gather
            with torch.cuda.stream(stream):
                dev_ids = self._ids_on_device(ids)
                staging = torch.empty(shape, dtype=self.dtype, device=dev)
                start = self._event() if self._timing else None
                split_heads(self.paged, dev_ids, staging, block_major=True)
                gathered = self._event()
                if host is None:
                    host = self._host_buffer((n, h, unit))
                down = staging.view(n, h, -1).view(torch.uint8)
                step = max(1, self._chunk_bytes // (h * unit))
                chunks = []
                for a in range(0, n, step):
                    host[a : a + step].copy_(down[a : a + step], non_blocking=True)
                    chunks.append(self._event())
            # The engine may overwrite the blocks once the kernel has read them; the staging
            # buffer is freed now and reused only after the copy (stream order on `stream`).
            engine.wait_event(gathered)
        timing = (start, gathered) if start is not None else None
        return StagedSave(host, chunks, step, timing)

    def device_gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks gathered into device staging, uint8 `[n, heads, payload bytes]`, by one launch
        queued on the connector's stream (the engine's stream waits for the kernel only); for a
        caller that moves the staging on from the device itself (`store_path`'s zero-copy save).
        On CPU tensors, done at once."""
        ids = self._checked_ids(block_ids, distinct=False)
        n, h = len(ids), self.num_kv_heads
        shape = self.paged.geometry.head_buffer_shape(n, block_major=True)
        if self._stream is None:
            staging = split_heads(self.paged, ids, block_major=True)
            return staging.reshape(n, h, -1).view(torch.uint8)
        assert self._engine_stream is not None
        dev, stream = self.device, self._stream
        with torch.cuda.device(dev):
            engine = torch.cuda.current_stream(dev)
            stream.wait_stream(engine)
            with torch.cuda.stream(stream):
                staging = torch.empty(shape, dtype=self.dtype, device=dev)
                split_heads(self.paged, self._ids_on_device(ids), staging, block_major=True)
                gathered = self._event()
            engine.wait_event(gathered)
        return staging.view(n, h, -1).view(torch.uint8)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The connector's CUDA stream (None on CPU tensors): what `device_gather` and
        `device_scatter` queue on, and where a caller queues copies that go with them."""
        return self._stream

    # --- load ----------------------------------------------------------------------------------

    def device_scatter(
        self, units: torch.Tensor, block_ids: Sequence[int], *, wait: bool = True
    ) -> None:
        """Write blocks whose payloads are in device staging `units` (uint8 `[>= n, heads,
        payload bytes]`, on the cache's device) into the cache: one launch queued on the
        connector's stream after the work already there; returns once the blocks are written
        (`wait` false: once queued; the caller waits for the stream)."""
        ids = self._checked_ids(block_ids, distinct=True)
        n = len(ids)
        if units.device != self.device or tuple(units.shape[1:]) != (
            self.num_kv_heads,
            self.payload_nbytes,
        ):
            raise LayoutError("device staging does not hold these blocks of this cache")
        if n == 0:
            return
        shape = self.paged.geometry.head_buffer_shape(n, block_major=True)
        staging = units[:n].reshape(-1).view(self.dtype).view(shape)
        if self._stream is None:
            merge_heads(staging, self.paged, ids, block_major=True)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            merge_heads(staging, self.paged, self._ids_on_device(ids), block_major=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        if wait:
            done.synchronize()

    def device_scatter_gated(
        self,
        units: torch.Tensor,
        block_ids: Sequence[int],
        flags: torch.Tensor,
        group_of: Sequence[int],
        first_head: int = 0,
    ) -> None:
        """Write the blocks whose payloads are in device staging `units` (uint8 `[n,
        object_heads, payload bytes]`; heads `[first_head, first_head + heads)` are this cache's)
        into the cache, block `i` only where the int32 `flags[0 .. group_of[i]]` are all nonzero
        (a load's verified prefix of objects): one launch queued on the connector's stream, the
        flags read there, so the host queues it before the checks are done and waits for
        nothing (the caller waits for the stream). On CPU tensors the flags are read at once."""
        ids = self._checked_ids(block_ids, distinct=True)
        n, h = len(ids), self.num_kv_heads
        heads = int(units.shape[1]) if units.dim() == 3 else -1
        if (
            units.device != self.device
            or units.dim() != 3
            or int(units.shape[0]) < n
            or int(units.shape[2]) != self.payload_nbytes
            or not 0 <= first_head <= heads - h
            or len(group_of) != n
        ):
            raise LayoutError("device staging does not hold these blocks of this cache")
        if n == 0:
            return
        if any(not 0 <= int(x) < flags.numel() for x in group_of):
            raise LayoutError("a block's group has no flag")
        shape = (n, heads, *self.paged.geometry.head_buffer_shape(1)[2:])
        staging = units[:n].reshape(-1).view(self.dtype).view(shape)
        if self._stream is None:
            merge_heads_gated(staging, self.paged, ids, flags, list(group_of), first_head)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            packed = self._ids_on_device([*ids, *(int(x) for x in group_of)])
            merge_heads_gated(staging, self.paged, packed[:n], flags, packed[n:], first_head)

    def load_staging(self, n: int) -> LoadStaging:
        """Pinned host staging for a load of `n` blocks, for payloads read straight into its
        slots (`SidecarClient.get_into`); then `scatter_staged`."""
        return LoadStaging(self._host_buffer((n, self.num_kv_heads, self.payload_nbytes)))

    def scatter_staged(self, staging: LoadStaging, block_ids: Sequence[int]) -> None:
        """Write blocks whose payloads are in `staging` into the cache: its first
        `len(block_ids)` blocks (a block-first prefix is one contiguous run), one copy to the
        device and one scatter launch; returns once the blocks are written."""
        ids = self._checked_ids(block_ids, distinct=True)
        if len(ids) > staging.num_blocks or staging.units.shape[1:] != (
            self.num_kv_heads,
            self.payload_nbytes,
        ):
            raise LayoutError("staging does not hold these blocks of this cache")
        self._upload(staging.units[: len(ids)].reshape(-1), ids, None)

    def scatter_payloads(
        self, payloads: Sequence[Sequence[Payload]], block_ids: Sequence[int]
    ) -> None:
        """Write `payloads[i][j]` (block `block_ids[i]`, local head `j`) into the cache: copied
        into pinned staging chunk by chunk (by `copy_threads`), each chunk's copy to the device
        overlapping the next one's assembly, then one scatter launch; returns once the blocks are
        written. Raises `LayoutError`, writing nothing, if any payload has the wrong size."""
        ids = self._checked_ids(block_ids, distinct=True)
        n, h, unit = len(ids), self.num_kv_heads, self.payload_nbytes
        if len(payloads) != n:
            raise LayoutError(f"{len(payloads)} payload rows for {n} blocks")
        flat: list[Payload] = []
        for i, row in enumerate(payloads):
            if len(row) != h:
                raise LayoutError(f"block {i}: {len(row)} head payloads for {h} heads")
            for data in row:
                if len(data) != unit:
                    raise LayoutError(f"payload of {len(data)} bytes, expected {unit}")
                flat.append(data)
        if n == 0:
            return
        host = self._host_buffer((n * h * unit,))
        rows = host.numpy().reshape(n * h, unit)

        def fill(a: int, b: int) -> None:
            for u in range(a, b):
                rows[u] = np.frombuffer(flat[u], dtype=np.uint8)

        self._upload(host, ids, fill)

    def _upload(
        self, host: torch.Tensor, ids: list[int], fill: Callable[[int, int], None] | None
    ) -> None:
        """Flat host staging of `len(ids)` blocks -> device -> cache. With `fill(a, b)` (puts
        payloads `[a, b)` into `host`), chunks are filled and copied up in a pipeline."""
        n, h, unit = len(ids), self.num_kv_heads, self.payload_nbytes
        units = n * h
        if n == 0:
            return
        shape = self.paged.geometry.head_buffer_shape(n, block_major=True)
        if self._stream is None:
            if fill is not None:
                fill(0, units)
            merge_heads(host.view(self.dtype).view(shape), self.paged, ids, block_major=True)
            return
        assert self._engine_stream is not None
        dev, stream = self.device, self._stream
        step = max(1, self._chunk_bytes // unit) if fill is not None else units
        chunks = [(a, min(a + step, units)) for a in range(0, units, step)]
        pool = self._copy_pool() if fill is not None and len(chunks) > 1 else None
        with torch.cuda.device(dev):
            stream.wait_stream(self._engine_stream)
            with torch.cuda.stream(stream):
                dev_ids = self._ids_on_device(ids)
                staging = torch.empty(units * unit, dtype=torch.uint8, device=dev)
                pending: list[Future[None]] = (
                    [pool.submit(fill, a, b) for a, b in chunks]
                    if pool is not None and fill is not None
                    else []
                )
                for k, (a, b) in enumerate(chunks):
                    if pending:
                        pending[k].result()
                    elif fill is not None:
                        fill(a, b)
                    staging[a * unit : b * unit].copy_(host[a * unit : b * unit], non_blocking=True)
                merge_heads(
                    staging.view(self.dtype).view(shape), self.paged, dev_ids, block_major=True
                )
                done = torch.cuda.Event()
                done.record(stream)
        done.synchronize()

    def close(self) -> None:
        """Stop the copy threads (idle ones cost nothing; for tests and shutdown)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # --- helpers -------------------------------------------------------------------------------

    def _checked_ids(self, block_ids: Sequence[int], *, distinct: bool) -> list[int]:
        """Block ids range-checked on the host (the kernels do not check a device tensor's)."""
        ids = [int(b) for b in block_ids]
        nb = self.paged.geometry.num_blocks
        bad = [b for b in ids if not 0 <= b < nb]
        if bad:
            raise LayoutError(f"block ids {bad[:4]} outside [0, {nb})")
        if distinct and len(set(ids)) != len(ids):
            raise LayoutError("a load writes each block once: block ids must be distinct")
        return ids

    def _ids_on_device(self, ids: list[int]) -> torch.Tensor:
        """Ids copied without a host wait (a pageable copy would wait for the whole stream)."""
        host = torch.tensor(ids, dtype=torch.int64).pin_memory()
        return host.to(self.device, non_blocking=True)

    def _event(self) -> torch.cuda.Event:
        """An event recorded on the current stream (timed when the cache is built to time)."""
        event = torch.cuda.Event(enable_timing=self._timing)
        event.record()
        return event

    def _host_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 host buffer: pinned while the pinned budget allows, else ordinary memory
        (then device copies wait for the host). Its pinned bytes count until its memory is
        freed, views and payloads of it included."""
        nbytes = 1
        for d in shape:
            nbytes *= d
        if self._stream is None:
            return torch.empty(shape, dtype=torch.uint8)
        with self._lock:
            pin = self._pinned + nbytes <= self._max_pinned
            if pin:
                self._pinned += nbytes
        if not pin:
            return torch.empty(shape, dtype=torch.uint8)
        try:
            buf = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            self._release_pinned(nbytes)
            raise
        weakref.finalize(buf.untyped_storage(), self._release_pinned, nbytes)
        return buf

    def _release_pinned(self, nbytes: int) -> None:
        with self._lock:
            self._pinned -= nbytes

    def _copy_pool(self) -> ThreadPoolExecutor | None:
        if self._copy_threads <= 1:
            return None
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._copy_threads, thread_name_prefix="ownerserve-kv-copy"
                )
            return self._pool
