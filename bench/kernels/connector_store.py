"""The vLLM connector's Mooncake Store path (`workers.vllm_connector.store_path.StoreKV` over
`CudaPagedKV`) on a GPU host, against pinned host<->device copies of the same bytes.

Request (as `connector_staging.py`): 64 of 1024 blocks of 16 tokens, 32 layers, 8 KV heads x
128, bf16, vLLM's FlashAttention layout: 128 MiB = 512 per-head payloads of 256 KiB. A real
`mooncake_master` (found beside this Python, in the `mooncake` package dir, or on PATH) and
the store clients run on this host, TCP protocol. Two placements, in one run:
- `own segment`: the connector's client mounts the segment the objects go to (what a
  connector with `store_segment_bytes` does): puts and gets are the store's local copies;
- `sidecar segment`: a second client (the sidecar's role) mounts it, the connector mounts
  none: every byte crosses the transfer engine (loopback TCP).
Per placement: save = gather into registered pinned staging (one kernel launch, copies down)
+ one batch put (`put_split`: XXH3-128 of each payload on the digest threads, then
`batch_put_from_multi_buffers`); load = one batch get into registered pinned slots
(`get_split`, each payload verified there) + one `scatter_staged` (copy up, one launch). Each
part is timed apart (kernel and copies with CUDA events; the hashing alone; the store call
alone, unhashed) and given as a share of the pinned copy in the same direction; target >= 80%
end to end. Checks, on fresh random KV into NaN-poisoned blocks: every load bit-exact, and a
TP-mismatch load (two TP=2 ranks of 4 heads each reading the TP=1 save) bit-exact.

A third placement, `zero copy` (`StoreKV(zero_copy=True)`, the default on a CUDA cache with its
own segment): save = gather into device staging + framing with the keyed-MAC digest on the
device (`gpu_digest.frame`) + objects reserved in the client's own segment, by chunks of
`--chunk-objects` (`reserve_local`: three master round trips each) + strided DMA copies
straight into them; load = replica lookup (`local_replicas`; cold: asked of the master every
time, cached: the `replica_cache_s` answers) + strided DMA copies up from the page-locked
segment + digest check and unframing on the device (`gpu_digest.unframe`) + one scatter. Parts:
kernels and copies with CUDA events, master round trips with host timers; the segment's
registration (once) apart. Checks: the objects in the segment are the reference payloads with
digests the numpy implementation agrees with, loads bit-exact (TP 1 -> 2 too), every object
moved directly (none through the store's own calls).

    python3 bench/kernels/connector_store.py --out FILE [--reps 10] [--digest-threads 8]
        [--replica-cache-s 5] [--chunk-objects 64] [--only zero-copy]

Needs PyTorch with CUDA, Triton, xxhash and the mooncake wheel (`mooncake.store`, its
`mooncake_master` executable); without CUDA it says so and exits 0. `--device cpu --small` runs
the same steps on CPU tensors (the tests' smoke run; no pinned memory, shares against a host
memcpy).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import reference as ref
from ownerserve.kvstate.heads import heads_for_rank
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    ClientSettings,
    MasterUnavailable,
    MooncakeMaster,
    StoreClient,
    StoreError,
)
from workers.mooncake_store.digest import mac_digests, verify
from workers.vllm_connector import gpu_digest
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.host_copy import copy_rows, strided_runs
from workers.vllm_connector.plan import block_keys, head_range, object_groups
from workers.vllm_connector.store_path import StoreKV

DT = torch.bfloat16
TARGET = 0.80
MODEL = "bench"


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    num_blocks: int
    n: int
    block_size: int
    heads: int
    dim: int


FULL = Shape(32, 1024, 64, 16, 8, 128)
SMALL = Shape(4, 64, 8, 16, 4, 32)


class Report:
    """Lines said and kept, and the checks that failed."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, name: str, ok: bool) -> None:
        self.say(f"check {name}: {'ok' if ok else 'FAIL'}")
        if not ok:
            self.failures.append(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(
    fn: Callable[[], object],
    device: torch.device,
    reps: int,
    before: Callable[[], object] | None = None,
) -> float:
    """Median host seconds of `fn` from an idle device (after 2 warm-up runs); `before` runs
    untimed ahead of each."""
    times = []
    for i in range(reps + 2):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fa_layers(shape: Shape, heads: int, device: torch.device) -> list[torch.Tensor]:
    """vLLM FlashAttention caches `[2, blocks, block_size, heads, dim]`, random."""
    return [
        torch.randn(2, shape.num_blocks, shape.block_size, heads, shape.dim, dtype=DT).to(device)
        for _ in range(shape.layers)
    ]


@contextlib.contextmanager
def client(
    master: MooncakeMaster, segment_bytes: int, digest_threads: int, replica_cache_s: float = 0.0
) -> Iterator[StoreClient]:
    c = StoreClient.open(
        ClientSettings(
            master.address,
            segment_bytes=segment_bytes,
            digest_threads=digest_threads,
            replica_cache_s=replica_cache_s,
        )
    )
    try:
        yield c
    finally:
        c.close()


def rows_of(shape: Shape, heads: Sequence[int]) -> list[list[str]]:
    return [block_keys(MODEL, 0x1000 + i, heads) for i in range(shape.n)]


def placement(
    r: Report,
    name: str,
    shape: Shape,
    device: torch.device,
    writer: StoreClient,
    reps: int,
    copy_up: float,
    copy_down: float,
) -> list[str]:
    """Save and load the request through `writer` (objects where the master puts them), time
    the parts, check the loads; the summary rows."""
    layers = fa_layers(shape, shape.heads, device)
    kv = CudaPagedKV(layers, timing=device.type == "cuda")
    unit = kv.payload_nbytes
    nbytes = shape.n * shape.heads * unit
    staging = 3 * shape.n * shape.heads * (unit + CHECKSUM_BYTES)  # two saves at once fit
    w = StoreKV(writer, kv, staging_bytes=staging, zero_copy=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    dst_ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    heads = list(range(shape.heads))
    rows = rows_of(shape, heads)
    keys = [k for row in rows for k in row]
    save_rows = [list(enumerate(row)) for row in rows]

    def remove() -> None:
        writer.remove(keys)

    def save() -> None:
        staged = w.gather(ids)
        assert staged is not None
        out = w.put(staged, save_rows)
        if out.refused:
            raise StoreError(f"the store refused {len(out.refused)} artifacts")

    remove()
    save()
    expect = ref.split_heads(kv.paged, ids, block_major=True).reshape(shape.n, shape.heads, -1)
    save_s = median_s(save, device, reps, before=remove)
    save()  # the objects the loads read

    # save parts: gather (kernel, copy down), hashing alone, the store's put alone
    staged = w.gather(ids)
    assert staged is not None
    staged.wait()
    r.check(
        f"{name}: staged payloads = reference split (bit-exact)",
        torch.equal(staged.units.view(shape.n, shape.heads, -1), expect.view(torch.uint8).cpu()),
    )
    gather_s = median_s(lambda: w.gather(ids).release(), device, reps)  # type: ignore[union-attr]
    kernel_ms = copy_ms = float("nan")
    if device.type == "cuda":
        parts = []
        for _ in range(reps):
            s = kv.gather(ids, host=staged.units)
            parts.append(s.timings_ms())
        kernel_ms = statistics.median(p[0] for p in parts)
        copy_ms = statistics.median(p[1] for p in parts)
    base = int(staged.units.data_ptr())
    dbase = int(staged.digests.data_ptr())
    addresses = [base + u * unit for u in range(len(keys))]
    digests = [dbase + u * CHECKSUM_BYTES for u in range(len(keys))]
    sizes = [unit] * len(keys)
    hash_s = median_s(lambda: writer._digests(addresses, sizes), device, reps)
    parts_in = [[a, d] for a, d in zip(addresses, digests, strict=True)]
    lengths = [[unit, CHECKSUM_BYTES] for _ in keys]
    raw = writer._store

    def raw_put() -> None:
        codes = raw.batch_put_from_multi_buffers(keys, parts_in, lengths)
        if any(int(c) != 0 for c in codes):
            raise StoreError(f"raw put failed: {sorted(set(map(int, codes)))}")

    put_s = median_s(raw_put, device, reps, before=remove)
    staged.release()
    remove()
    save()

    # load: into NaN-poisoned blocks, all heads, then two TP=2 ranks
    dst_layers = [torch.full_like(t, float("nan")) for t in layers]
    reader = StoreKV(writer, CudaPagedKV(dst_layers), staging_bytes=staging, zero_copy=False)

    def poison() -> None:
        for t in dst_layers:
            t[:, dst_ids] = float("nan")

    def exact(dst: list[torch.Tensor], part: slice = slice(None)) -> bool:
        return all(
            torch.equal(b[:, dst_ids].view(torch.int16), a[:, ids][..., part, :].view(torch.int16))
            for a, b in zip(layers, dst, strict=True)
        )

    poison()
    got = reader.load(rows, dst_ids)
    r.check(
        f"{name}: load into NaN-poisoned blocks = source blocks (bit-exact)",
        got.load.blocks == shape.n and got.load.refused is None and exact(dst_layers),
    )
    load_s = median_s(lambda: reader.load(rows, dst_ids), device, reps, before=poison)
    for rank in range(2):
        local = heads_for_rank(shape.heads, 2, rank)
        tp_layers = fa_layers(shape, len(local), device)
        for t in tp_layers:
            t.fill_(float("nan"))
        tp = StoreKV(writer, CudaPagedKV(tp_layers), staging_bytes=staging, zero_copy=False)
        got = tp.load(rows_of(shape, local), dst_ids)
        r.check(
            f"{name}: TP=2 rank {rank} (heads {local[0]}-{local[-1]}) load of the TP=1 save "
            "(bit-exact)",
            got.load.blocks == shape.n and exact(tp_layers, slice(local[0], local[-1] + 1)),
        )
        tp.close()

    # load parts: the store's get alone (unverified), verifying alone, copy up + scatter
    slots = reader._loads.take(shape.n * shape.heads * (unit + CHECKSUM_BYTES))
    assert slots is not None
    sbase = int(slots[1].data_ptr())
    s_addr = [sbase + u * unit for u in range(len(keys))]
    s_dig = [sbase + len(keys) * unit + u * CHECKSUM_BYTES for u in range(len(keys))]
    s_parts = [[a, d] for a, d in zip(s_addr, s_dig, strict=True)]

    def raw_get() -> None:
        codes = raw.batch_get_into_multi_buffers(keys, s_parts, lengths)
        if any(int(c) != unit + CHECKSUM_BYTES for c in codes):
            raise StoreError(f"raw get failed: {sorted(set(map(int, codes)))}")

    get_s = median_s(raw_get, device, reps)
    verify_s = median_s(lambda: writer._digests(s_addr, sizes), device, reps)
    from workers.vllm_connector.gpu import LoadStaging

    units = slots[1][: len(keys) * unit].view(shape.n, shape.heads, unit)
    scatter_s = median_s(
        lambda: reader.kv.scatter_staged(LoadStaging(units), dst_ids),  # type: ignore[attr-defined]
        device,
        reps,
    )
    reader._loads.give(slots[0], shape.n * shape.heads * (unit + CHECKSUM_BYTES))
    reader.close()
    w.close()
    remove()

    save_share = gbs(nbytes, save_s) / copy_down
    load_share = gbs(nbytes, load_s) / copy_up

    def row(what: str, seconds: float, copy: float | None, target: bool = False) -> str:
        share = "" if copy is None else f"{gbs(nbytes, seconds) / copy:.1%}"
        verdict = ""
        if target and copy is not None:
            verdict = "met" if gbs(nbytes, seconds) / copy >= TARGET else "NOT met"
        rate = gbs(nbytes, seconds)
        return f"| {name}: {what} | {seconds * 1e3:.3f} | {rate:.1f} | {share} | {verdict} |"

    r.say(
        f"{name}: save {save_s * 1e3:.3f} ms = {save_share:.1%} of the copy down; load "
        f"{load_s * 1e3:.3f} ms = {load_share:.1%} of the copy up"
    )
    return [
        row("save end to end (gather + put_split)", save_s, copy_down, target=True),
        row("of it: gather into registered staging, copy down waited", gather_s, copy_down),
        f"| {name}: of it: gather kernel / copy down (CUDA events) | {kernel_ms:.4f} / "
        f"{copy_ms:.3f} | | | |",
        row(
            f"of it: XXH3-128 of {len(keys)} payloads ({writer.settings.digest_threads} threads)",
            hash_s,
            None,
        ),
        row("of it: the store's batch put alone (unhashed)", put_s, copy_down),
        row("load end to end (get_split + scatter_staged)", load_s, copy_up, target=True),
        row("of it: the store's batch get alone (unverified)", get_s, copy_up),
        row(f"of it: verifying {len(keys)} payloads", verify_s, None),
        row("of it: copy up + scatter kernel", scatter_s, copy_up),
    ]


def part_ms(
    device: torch.device,
    stream: torch.cuda.Stream | None,
    fn: Callable[[], object],
    reps: int,
    before: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of `fn`'s device work (CUDA events on `stream`; host time on the
    CPU), after 2 warm-up runs."""
    if device.type != "cuda" or stream is None:
        return median_s(fn, device, reps, before) * 1e3
    times = []
    for i in range(reps + 2):
        if before is not None:
            before()
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def zero_copy(
    r: Report,
    shape: Shape,
    device: torch.device,
    master: MooncakeMaster,
    segment: int,
    reps: int,
    chunk_objects: int,
    copy_up: float,
    copy_down: float,
) -> list[str]:
    """The zero-copy placement: save and load through the client's own segment directly, the
    parts timed apart, the checks; the summary rows."""
    name = "zero copy"
    c = StoreClient.open(ClientSettings(master.address, segment_bytes=segment, replica_cache_s=5))
    try:
        return _zero_copy(r, name, shape, device, c, reps, chunk_objects, copy_up, copy_down)
    finally:
        c.close()


def _zero_copy(
    r: Report,
    name: str,
    shape: Shape,
    device: torch.device,
    c: StoreClient,
    reps: int,
    chunk_objects: int,
    copy_up: float,
    copy_down: float,
) -> list[str]:
    layers = fa_layers(shape, shape.heads, device)
    kv = CudaPagedKV(layers)
    unit = kv.payload_nbytes
    size = unit + CHECKSUM_BYTES
    nbytes = shape.n * shape.heads * unit
    staging = 3 * shape.n * shape.heads * size
    w = StoreKV(c, kv, staging_bytes=staging, zero_copy=True, chunk_objects=chunk_objects)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    dst_ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    rows = rows_of(shape, list(range(shape.heads)))
    keys = [k for row in rows for k in row]
    save_rows = [list(enumerate(row)) for row in rows]
    store_s: list[float] = []

    def remove() -> None:
        c.remove(keys)

    def save() -> None:
        staged = w.gather(ids)
        assert staged is not None and staged.on_device
        out = w.put(staged, save_rows)
        if out.refused:
            raise StoreError(f"the store refused {len(out.refused)} artifacts")
        store_s.append(w.counts.last_save_store_s)

    remove()
    save()
    assert w._segments is not None
    register_s = w._segments.register_s
    registered = w._segments.registered_bytes
    # what the save left in the segment: the reference payloads, digests numpy agrees with
    expect = ref.split_heads(kv.paged, ids, block_major=True).reshape(len(keys), -1)
    expect_bytes = expect.view(torch.uint8).cpu().numpy()
    replicas = c.local_replicas(keys)
    held = [ctypes.string_at(p.address, p.size) if p is not None else b"" for p in replicas]
    r.check(
        f"{name}: every object in the client's own segment, payload = reference split (bit-exact)",
        all(len(o) == size for o in held)
        and all(o[:unit] == expect_bytes[i].tobytes() for i, o in enumerate(held)),
    )
    sample = list(range(0, len(keys), max(1, len(keys) // 16)))
    want = mac_digests([keys[i] for i in sample], [held[i][:unit] for i in sample])
    r.check(
        f"{name}: the device's digests = the numpy implementation's ({len(sample)} objects)",
        [held[i][unit:] for i in sample] == want,
    )
    r.check(
        f"{name}: every object saved directly",
        w.counts.saved_direct == len(keys) and w.counts.saved_through_store == 0,
    )
    store_s.clear()
    save_s = median_s(save, device, reps, before=remove)
    save_store_ms = statistics.median(store_s) * 1e3
    sweep = []
    for ch in sorted({32, 64, 128, 512} - {chunk_objects})[:3]:
        w.chunk_objects = ch
        sweep.append((ch, median_s(save, device, reps, before=remove)))
    w.chunk_objects = chunk_objects

    # save parts: gather kernel, framing + digest kernel, reservations alone, copy down alone
    stream = kv.stream
    gather_ms = part_ms(device, stream, lambda: kv.device_gather(ids), reps)
    flat = kv.device_gather(ids).view(-1, unit)
    lanes = gpu_digest.keys_tensor(keys, unit, device)
    objects = torch.empty((len(keys), size), dtype=torch.uint8, device=device)
    frame_ms = part_ms(device, stream, lambda: gpu_digest.frame(flat, lanes, objects), reps)
    other = [f"{k}#copy" for k in keys]

    def reserve() -> list[object]:
        got: list[object] = []
        for a in range(0, len(other), chunk_objects):
            got += c.reserve_local(other[a : a + chunk_objects], size)
        return got

    reserve_s = median_s(reserve, device, reps, before=lambda: c.remove(other))
    c.remove(other)
    spots = reserve()
    addresses = [int(p.address) for p in spots]  # type: ignore[attr-defined]
    runs = strided_runs(list(range(len(other))), addresses, size)
    for p in addresses:
        assert w._segments.ready(p, size)

    def copy_down_direct() -> None:
        for run in runs:
            copy_rows(
                addresses[run.first], run.pitch,
                int(objects[run.first].data_ptr()), size, size, run.count, device,
            )  # fmt: skip

    down_ms = part_ms(device, stream, copy_down_direct, reps)

    def copy_up_direct() -> None:
        for run in runs:
            copy_rows(
                int(objects[run.first].data_ptr()), size,
                addresses[run.first], run.pitch, size, run.count, device,
            )  # fmt: skip

    up_ms = part_ms(device, stream, copy_up_direct, reps)
    c.remove(other)
    remove()
    save()

    # load: into NaN-poisoned blocks, replicas asked of the master each time and cached
    dst_layers = [torch.full_like(t, float("nan")) for t in layers]
    reader = StoreKV(c, CudaPagedKV(dst_layers), staging_bytes=staging, zero_copy=True)
    reader.chunk_objects = chunk_objects
    lookup_s: list[float] = []

    def poison() -> None:
        for t in dst_layers:
            t[:, dst_ids] = float("nan")

    def cold() -> None:
        poison()
        c.forget_local(keys)

    def load() -> None:
        reader.load(rows, dst_ids)
        lookup_s.append(reader.counts.last_load_store_s)

    def exact(dst: list[torch.Tensor], part: slice = slice(None)) -> bool:
        return all(
            torch.equal(b[:, dst_ids].view(torch.int16), a[:, ids][..., part, :].view(torch.int16))
            for a, b in zip(layers, dst, strict=True)
        )

    cold()
    got = reader.load(rows, dst_ids)
    r.check(
        f"{name}: load into NaN-poisoned blocks = source blocks (bit-exact), all read directly",
        got.load.blocks == shape.n
        and got.load.refused is None
        and exact(dst_layers)
        and reader.counts.loaded_direct == len(keys)
        and reader.counts.loaded_through_store == 0,
    )
    lookup_s.clear()
    load_cold_s = median_s(load, device, reps, before=cold)
    lookup_cold_ms = statistics.median(lookup_s) * 1e3
    lookup_s.clear()
    load_hot_s = median_s(load, device, reps, before=poison)
    lookup_hot_ms = statistics.median(lookup_s) * 1e3
    r.check(f"{name}: loads timed bit-exact", exact(dst_layers))
    for rank in range(2):
        local = heads_for_rank(shape.heads, 2, rank)
        tp_layers = fa_layers(shape, len(local), device)
        for t in tp_layers:
            t.fill_(float("nan"))
        tp = StoreKV(c, CudaPagedKV(tp_layers), staging_bytes=staging, zero_copy=True)
        got = tp.load(rows_of(shape, local), dst_ids)
        r.check(
            f"{name}: TP=2 rank {rank} (heads {local[0]}-{local[-1]}) load of the TP=1 save "
            "(bit-exact, all read directly)",
            got.load.blocks == shape.n
            and exact(tp_layers, slice(local[0], local[-1] + 1))
            and tp.counts.loaded_through_store == 0,
        )
        tp.close()

    # load parts: the lookup alone, the digest check + unframing, the scatter
    lookup_ms = median_s(lambda: c.local_replicas(keys), device, reps) * 1e3
    # what the master's round trips cost: one call of every key, the binding's answer alone,
    # and the chunks on threads at once
    raw = c._store
    raw_desc_ms = median_s(lambda: raw.batch_get_replica_desc(keys), device, reps) * 1e3
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.preferred_segment = c.segment
    sizes = [size] * len(other)
    start_ms = (
        median_s(
            lambda: raw.batch_put_session_start(other, sizes, config),
            device,
            reps,
            before=lambda: c.remove(other),
        )
        * 1e3
    )
    end_ms = (
        median_s(
            lambda: raw.batch_put_session_end(other),
            device,
            reps,
            before=lambda: (c.remove(other), raw.batch_put_session_start(other, sizes, config)),
        )
        * 1e3
    )
    c.remove(other)
    pool = ThreadPoolExecutor(4)
    parts = [keys[a : a + chunk_objects] for a in range(0, len(keys), chunk_objects)]
    threaded_ms = median_s(lambda: list(pool.map(c.local_replicas, parts)), device, reps) * 1e3
    pool.shutdown()
    payloads = torch.empty((shape.n, shape.heads, unit), dtype=torch.uint8, device=device)
    unframe_ms = part_ms(
        device,
        stream,
        lambda: gpu_digest.unframe(objects, lanes, payloads.view(-1, unit)),
        reps,
    )
    rk = reader.kv
    assert isinstance(rk, CudaPagedKV)
    scatter_ms = part_ms(device, rk.stream, lambda: rk.device_scatter(payloads, dst_ids), reps)
    reader.close()
    w.close()
    remove()

    def row(what: str, seconds: float, copy: float | None, target: bool = False) -> str:
        rate = gbs(nbytes, seconds)
        share = "" if copy is None else f"{rate / copy:.1%}"
        verdict = ""
        if target and copy is not None:
            verdict = "met" if rate / copy >= TARGET else "NOT met"
        return f"| {name}: {what} | {seconds * 1e3:.3f} | {rate:.1f} | {share} | {verdict} |"

    r.say(
        f"{name}: save {save_s * 1e3:.3f} ms = {gbs(nbytes, save_s) / copy_down:.1%} of the copy "
        f"down; load {load_cold_s * 1e3:.3f} ms (replicas looked up) = "
        f"{gbs(nbytes, load_cold_s) / copy_up:.1%}, {load_hot_s * 1e3:.3f} ms (cached) = "
        f"{gbs(nbytes, load_hot_s) / copy_up:.1%} of the copy up; segment registered once: "
        f"{registered / 2**20:.0f} MiB in {register_s * 1e3:.1f} ms"
    )
    out = [
        row(
            f"save end to end (device gather + frame/digest + reserve by {chunk_objects} + "
            "copy down)",
            save_s,
            copy_down,
            target=True,
        ),
    ]
    out += [row(f"save end to end, reserving by {ch}", t, copy_down) for ch, t in sweep]
    out += [
        row("of it: gather kernel (CUDA events)", gather_ms / 1e3, None),
        row(
            f"of it: frame + keyed-MAC digest kernel, {len(keys)} objects (CUDA events)",
            frame_ms / 1e3,
            None,
        ),
        row(
            f"of it: reserve_local alone ({-(-len(keys) // chunk_objects)} x 3 master round trips)",
            reserve_s,
            None,
        ),
        row("of it: master round trips inside the timed saves (median)", save_store_ms / 1e3, None),
        row(
            f"of it: strided copy down alone ({len(runs)} copies, CUDA events)",
            down_ms / 1e3,
            copy_down,
        ),
        row(
            "load end to end, replicas looked up (lookup + copy up + check/unframe + scatter)",
            load_cold_s,
            copy_up,
            target=True,
        ),
        row("load end to end, replicas cached", load_hot_s, copy_up, target=True),
        row("of it: replica lookup alone (local_replicas, uncached)", lookup_ms / 1e3, None),
        row(
            "of it: lookups inside the timed loads, looked up (median)", lookup_cold_ms / 1e3, None
        ),
        row("of it: lookups inside the timed loads, cached (median)", lookup_hot_ms / 1e3, None),
        row(
            f"master: batch_get_replica_desc of {len(keys)} keys, one call, answer unread",
            raw_desc_ms / 1e3,
            None,
        ),
        row(f"master: batch_put_session_start of {len(keys)} keys", start_ms / 1e3, None),
        row(f"master: batch_put_session_end of {len(keys)} keys", end_ms / 1e3, None),
        row(
            f"master: local_replicas by {chunk_objects} on 4 threads at once",
            threaded_ms / 1e3,
            None,
        ),
        row(
            f"of it: strided copy up alone ({len(runs)} copies, CUDA events)", up_ms / 1e3, copy_up
        ),
        row("of it: digest check + unframe kernel (CUDA events)", unframe_ms / 1e3, None),
        row("of it: scatter kernel (CUDA events)", scatter_ms / 1e3, None),
    ]
    return out


def grouped(
    r: Report,
    shape: Shape,
    device: torch.device,
    c: StoreClient,
    reps: int,
    blocks_per_object: int,
    copy_up: float,
    copy_down: float,
) -> list[str]:
    """The grouped layout, zero copy: one object per `blocks_per_object` blocks with every
    head; save and load through the client's own segment, the parts timed apart, the checks
    (objects = the reference bytes, loads bit-exact, TP 1 -> 2 bit-exact); the summary rows."""
    name = f"grouped by {blocks_per_object}"
    layers = fa_layers(shape, shape.heads, device)
    kv = CudaPagedKV(layers)
    unit = kv.payload_nbytes
    nbytes = shape.n * shape.heads * unit
    staging = 3 * nbytes
    w = StoreKV(c, kv, staging_bytes=staging, zero_copy=True, chunk_objects=64)
    g = torch.Generator().manual_seed(2)
    ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    dst_ids = torch.randperm(shape.num_blocks, generator=g)[: shape.n].tolist()
    hashes = [0x5000 + blocks_per_object * 0x10000 + i for i in range(shape.n)]
    gs = object_groups(MODEL, 0, hashes, shape.heads, blocks_per_object)
    keys = [x.key for x in gs]
    sizes = [x.count * shape.heads * unit + CHECKSUM_BYTES for x in gs]
    store_s: list[float] = []

    def remove() -> None:
        c.remove(keys)

    def save(ahead: bool = True) -> None:
        staged = w.gather(ids, groups=gs if ahead else None)
        assert staged is not None and staged.on_device
        out = w.put_groups(staged, gs)
        if out.refused:
            raise StoreError(f"the store refused {len(out.refused)} objects")
        store_s.append(w.counts.last_save_store_s)

    remove()
    save()
    expect = ref.split_heads(kv.paged, ids, block_major=True).reshape(-1)
    expect_bytes = expect.view(torch.uint8).cpu().numpy().tobytes()
    replicas = c.local_replicas(keys)
    held = [ctypes.string_at(p.address, p.size) if p is not None else b"" for p in replicas]
    at = [x.first * shape.heads * unit for x in gs]
    r.check(
        f"{name}: every object in the client's own segment = the blocks' reference bytes",
        all(len(o) == n for o, n in zip(held, sizes, strict=True))
        and all(
            o[:-CHECKSUM_BYTES] == expect_bytes[a : a + n - CHECKSUM_BYTES]
            for o, a, n in zip(held, at, sizes, strict=True)
        ),
    )
    r.check(
        f"{name}: the device's digests verify on the CPU (digest.verify)",
        all(
            verify(k, o[:-CHECKSUM_BYTES], o[-CHECKSUM_BYTES:])
            for k, o in zip(keys[:2], held[:2], strict=True)
        ),
    )
    r.check(f"{name}: every object saved directly", w.counts.saved_through_store == 0)
    store_s.clear()
    save_s = median_s(save, device, reps, before=remove)
    save_store_ms = statistics.median(store_s) * 1e3
    late_s = median_s(lambda: save(ahead=False), device, reps, before=remove)
    w.first_chunk_objects = len(gs)
    one_s = median_s(save, device, reps, before=remove)
    w.first_chunk_objects = 1

    # parts: gather, digests, reservations alone, copy down / up alone (payload + digest each)
    stream = kv.stream
    gather_ms = part_ms(device, stream, lambda: kv.device_gather(ids), reps)
    flat = kv.device_gather(ids).reshape(-1)
    digests = torch.empty((len(gs), CHECKSUM_BYTES), dtype=torch.uint8, device=device)
    digest_ms = part_ms(
        device,
        stream,
        lambda: w._digest_groups(flat, gs, keys, shape.heads, digests, check=False),
        reps,
    )
    other = [f"{k}#copy" for k in keys]
    reserve_s = median_s(
        lambda: c.reserve_local(other, sizes), device, reps, before=lambda: c.remove(other)
    )
    c.remove(other)
    spots = c.reserve_local(other, sizes)
    addresses = [int(p.address) for p in spots]  # type: ignore[union-attr]
    base, dbase = int(flat.data_ptr()), int(digests.data_ptr())
    for a, n in zip(addresses, sizes, strict=True):
        assert w._segments is not None and w._segments.ready(a, n)
    at = [x.first * shape.heads * unit for x in gs]
    d = CHECKSUM_BYTES

    def copy_down_direct() -> None:
        for i, a in enumerate(addresses):
            n = sizes[i] - d
            copy_rows(a, n, base + at[i], n, n, 1, device)
            copy_rows(a + n, d, dbase + i * d, d, d, 1, device)

    def copy_up_direct() -> None:
        for i, a in enumerate(addresses):
            n = sizes[i] - d
            copy_rows(base + at[i], n, a, n, n, 1, device)
            copy_rows(dbase + i * d, d, a + n, d, d, 1, device)

    down_ms = part_ms(device, stream, copy_down_direct, reps)
    up_ms = part_ms(device, stream, copy_up_direct, reps)
    raw = c._store
    desc_ms = median_s(lambda: raw.batch_get_replica_desc(keys), device, reps) * 1e3
    lookup_ms = median_s(lambda: c.local_replicas(keys), device, reps) * 1e3
    c.remove(other)
    remove()
    save()

    # loads: all heads into NaN-poisoned blocks, looked up and cached; both TP=2 ranks
    dst_layers = [torch.full_like(t, float("nan")) for t in layers]
    reader = StoreKV(c, CudaPagedKV(dst_layers), staging_bytes=staging, zero_copy=True)
    lookup_s: list[float] = []

    def poison() -> None:
        for t in dst_layers:
            t[:, dst_ids] = float("nan")

    def cold() -> None:
        poison()
        c.forget_local(keys)

    def load() -> None:
        got = reader.load_groups(gs, dst_ids)
        assert got.load.blocks == shape.n
        lookup_s.append(reader.counts.last_load_store_s)

    def exact(dst: list[torch.Tensor], part: slice = slice(None)) -> bool:
        return all(
            torch.equal(b[:, dst_ids].view(torch.int16), a[:, ids][..., part, :].view(torch.int16))
            for a, b in zip(layers, dst, strict=True)
        )

    cold()
    got = reader.load_groups(gs, dst_ids)
    r.check(
        f"{name}: load into NaN-poisoned blocks = source blocks (bit-exact), all read directly",
        got.load.blocks == shape.n
        and got.load.refused is None
        and exact(dst_layers)
        and reader.counts.loaded_through_store == 0,
    )
    load_cold_s = median_s(load, device, reps, before=cold)
    lookup_cold_ms = statistics.median(lookup_s) * 1e3
    lookup_s.clear()
    load_hot_s = median_s(load, device, reps, before=poison)
    lookup_hot_ms = statistics.median(lookup_s) * 1e3
    r.check(f"{name}: loads timed bit-exact", exact(dst_layers))
    tp_s: list[float] = []
    for rank in range(2):
        lo, hi = head_range(heads_for_rank(shape.heads, 2, rank))
        tp_layers = fa_layers(shape, hi - lo, device)
        for t in tp_layers:
            t.fill_(float("nan"))
        tp = StoreKV(c, CudaPagedKV(tp_layers), staging_bytes=staging, zero_copy=True)
        got = tp.load_groups(gs, dst_ids, object_heads=shape.heads, first_head=lo)
        r.check(
            f"{name}: TP=2 rank {rank} (heads {lo}-{hi - 1}) load of the TP=1 save "
            "(bit-exact, whole objects read directly)",
            got.load.blocks == shape.n
            and exact(tp_layers, slice(lo, hi))
            and tp.counts.loaded_through_store == 0,
        )

        def tp_load(tp: StoreKV = tp, lo: int = lo) -> None:
            tp.load_groups(gs, dst_ids, object_heads=shape.heads, first_head=lo)

        tp_s.append(median_s(tp_load, device, reps))
        tp.close()
    check_ms = part_ms(
        device,
        stream,
        lambda: w._digest_groups(flat, gs, keys, shape.heads, digests, check=True),
        reps,
    )
    rk = reader.kv
    assert isinstance(rk, CudaPagedKV)
    staged = flat.view(shape.n, shape.heads, unit)
    scatter_ms = part_ms(device, rk.stream, lambda: rk.device_scatter(staged, dst_ids), reps)
    reader.close()
    w.close()
    remove()

    def row(what: str, seconds: float, copy: float | None, target: bool = False) -> str:
        rate = gbs(nbytes, seconds)
        share = "" if copy is None else f"{rate / copy:.1%}"
        verdict = ""
        if target and copy is not None:
            verdict = "met" if rate / copy >= TARGET else "NOT met"
        return f"| {name}: {what} | {seconds * 1e3:.3f} | {rate:.1f} | {share} | {verdict} |"

    r.say(
        f"{name}: {len(gs)} objects of {sizes[0] >> 20} MiB; save {save_s * 1e3:.3f} ms = "
        f"{gbs(nbytes, save_s) / copy_down:.1%} of the copy down; load {load_cold_s * 1e3:.3f} ms"
        f" (looked up) = {gbs(nbytes, load_cold_s) / copy_up:.1%}, {load_hot_s * 1e3:.3f} ms "
        f"(cached) = {gbs(nbytes, load_hot_s) / copy_up:.1%} of the copy up"
    )
    return [
        row(
            f"save end to end ({len(gs)} objects reserved at gather, chunks 1, 2, 4, ...)",
            save_s,
            copy_down,
            target=True,
        ),
        row("save, reserved in put_groups (after the gather)", late_s, copy_down),
        row("save, reserved at gather in one round trip chain", one_s, copy_down),
        row("of it: gather kernel (CUDA events)", gather_ms / 1e3, None),
        row("of it: keyed-MAC digest kernels, read in place (CUDA events)", digest_ms / 1e3, None),
        row(f"of it: reserve_local of {len(gs)} objects alone (3 round trips)", reserve_s, None),
        row("of it: reservations waited for inside the timed saves", save_store_ms / 1e3, None),
        row(
            f"of it: copy down alone ({len(gs)} payloads + digests, CUDA events)",
            down_ms / 1e3,
            copy_down,
        ),
        row(
            "load end to end, replicas looked up (lookup + copy up + check/unframe + scatter)",
            load_cold_s,
            copy_up,
            target=True,
        ),
        row("load end to end, replicas cached", load_hot_s, copy_up, target=True),
        row(
            "TP=2 rank 0 / 1 load, cached (whole objects: 2x the bytes, half the heads)",
            statistics.mean(tp_s),
            copy_up,
        ),
        row(
            "of it: lookups waited for inside the timed loads, looked up",
            lookup_cold_ms / 1e3,
            None,
        ),
        row("of it: lookups waited for inside the timed loads, cached", lookup_hot_ms / 1e3, None),
        row(f"of it: local_replicas of {len(gs)} keys alone (uncached)", lookup_ms / 1e3, None),
        row(
            f"master: batch_get_replica_desc of {len(gs)} keys, answer unread", desc_ms / 1e3, None
        ),
        row(
            f"of it: copy up alone ({len(gs)} payloads + digests, CUDA events)",
            up_ms / 1e3,
            copy_up,
        ),
        row("of it: digest check kernels, read in place (CUDA events)", check_ms / 1e3, None),
        row("of it: scatter kernel (CUDA events)", scatter_ms / 1e3, None),
    ]


def run(
    shape: Shape,
    device: torch.device,
    *,
    reps: int,
    digest_threads: int,
    replica_cache_s: float,
    master_log: Path | None,
    chunk_objects: int = 64,
    only_zero_copy: bool = False,
    group_blocks: Sequence[int] = (8,),
    per_head: bool = True,
) -> Report:
    r = Report()
    r.say(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
        f"torch {torch.__version__}; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    )
    unit = shape.layers * 2 * shape.block_size * shape.dim * 2
    nbytes = shape.n * shape.heads * unit
    r.say(
        f"request: {shape.n} blocks x {shape.layers} layers x 2 x {shape.block_size} x "
        f"{shape.heads} heads x {shape.dim}, bf16 = {nbytes / 2**20:.1f} MiB "
        f"({shape.n * shape.heads} payloads of {unit >> 10} KiB)"
    )
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    if device.type == "cuda":
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        up = median_s(lambda: dev.copy_(host, non_blocking=True), device, reps)
        down = median_s(lambda: host.copy_(dev, non_blocking=True), device, reps)
        what = "pinned"
    else:
        other = torch.empty_like(host)
        up = down = median_s(lambda: other.copy_(host), device, reps)
        what = "host memcpy (no device)"
    copy_up, copy_down = gbs(nbytes, up), gbs(nbytes, down)
    r.say(
        f"{what} copy up {up * 1e3:.3f} ms = {copy_up:.1f} GB/s; "
        f"down {down * 1e3:.3f} ms = {copy_down:.1f} GB/s"
    )
    segment = max(64 << 20, -(-3 * nbytes // (16 << 20)) * (16 << 20))
    rows = [
        "",
        "| what | ms | GB/s | share of the copy | target >= 80% |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| {what} copy up, {nbytes / 2**20:.1f} MiB | {up * 1e3:.3f} | {copy_up:.1f} | 100% | |",
        f"| {what} copy down | {down * 1e3:.3f} | {copy_down:.1f} | 100% | |",
    ]
    with MooncakeMaster(log_path=master_log) as master:
        r.say(f"mooncake_master {master.binary} at {master.address.url}")
        r.say(f"digest threads {digest_threads}, replica cache {replica_cache_s} s")
        r.say(f"zero copy: reservations and lookups by {chunk_objects} objects")
        if per_head:
            rows += zero_copy(
                r, shape, device, master, segment, reps, chunk_objects, copy_up, copy_down
            )
        if group_blocks:
            # room for a save, its reserved copies and the largest object's size class
            room = max(64 << 20, -(-6 * nbytes // (16 << 20)) * (16 << 20))
            c = StoreClient.open(
                ClientSettings(master.address, segment_bytes=room, replica_cache_s=5)
            )
            try:
                for n in group_blocks:
                    rows += grouped(r, shape, device, c, reps, n, copy_up, copy_down)
            finally:
                c.close()
        if not only_zero_copy:
            with client(master, segment, digest_threads, replica_cache_s) as own:
                rows += placement(r, "own segment", shape, device, own, reps, copy_up, copy_down)
            with (
                client(master, segment, 1) as _sidecar,
                client(master, 0, digest_threads, replica_cache_s) as conn,
            ):
                rows += placement(
                    r, "sidecar segment", shape, device, conn, reps, copy_up, copy_down
                )
    rows += [
        "",
        "checks: " + ("all passed" if not r.failures else "FAILED: " + "; ".join(r.failures)),
    ]
    for line in rows:
        r.say(line)
    return r


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, help="write the report (markdown) here too")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--digest-threads", type=int, default=8)
    ap.add_argument(
        "--replica-cache-s",
        type=float,
        default=5.0,
        help="the store client's replica cache (the connector's default; 0: every get asks the "
        "master)",
    )
    ap.add_argument(
        "--chunk-objects",
        type=int,
        default=64,
        help="objects per master round trip of a zero-copy save or load",
    )
    ap.add_argument(
        "--only",
        choices=["zero-copy", "grouped"],
        help="zero-copy: the zero-copy placements alone, per head and grouped (the others take "
        "minutes); grouped: the grouped layout alone",
    )
    ap.add_argument(
        "--group-blocks",
        default="8",
        help="comma-separated blocks per object of the grouped layout to run (empty: none)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a small request (smoke runs)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("connector_store: skipped, no CUDA device (--device cpu runs the CPU smoke)")
        return 0
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r = run(
                SMALL if args.small else FULL,
                device,
                reps=args.reps,
                digest_threads=args.digest_threads,
                replica_cache_s=args.replica_cache_s,
                master_log=Path(tmp) / "master.log",
                chunk_objects=args.chunk_objects,
                only_zero_copy=args.only is not None,
                group_blocks=[int(x) for x in args.group_blocks.split(",") if x.strip()],
                per_head=args.only != "grouped",
            )
        except MasterUnavailable as exc:
            print(f"connector_store: no Mooncake master can run here: {exc}")
            return 2
    if args.out:
        args.out.write_text("\n".join(r.lines) + "\n")
    return 1 if r.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
