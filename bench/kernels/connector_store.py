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

    python3 bench/kernels/connector_store.py --out FILE [--reps 10] [--digest-threads 8]
        [--replica-cache-s 5]

Needs PyTorch with CUDA, Triton, xxhash and the mooncake wheel (`mooncake.store`, its
`mooncake_master` executable); without CUDA it says so and exits 0. `--device cpu --small` runs
the same steps on CPU tensors (the tests' smoke run; no pinned memory, shares against a host
memcpy).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
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
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.plan import block_keys
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
    w = StoreKV(writer, kv, staging_bytes=staging)
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
    reader = StoreKV(writer, CudaPagedKV(dst_layers), staging_bytes=staging)

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
        tp = StoreKV(writer, CudaPagedKV(tp_layers), staging_bytes=staging)
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


def run(
    shape: Shape,
    device: torch.device,
    *,
    reps: int,
    digest_threads: int,
    replica_cache_s: float,
    master_log: Path | None,
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
        with client(master, segment, digest_threads, replica_cache_s) as own:
            rows += placement(r, "own segment", shape, device, own, reps, copy_up, copy_down)
        with (
            client(master, segment, 1) as _sidecar,
            client(master, 0, digest_threads, replica_cache_s) as conn,
        ):
            rows += placement(r, "sidecar segment", shape, device, conn, reps, copy_up, copy_down)
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
            )
        except MasterUnavailable as exc:
            print(f"connector_store: no Mooncake master can run here: {exc}")
            return 2
    if args.out:
        args.out.write_text("\n".join(r.lines) + "\n")
    return 1 if r.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
