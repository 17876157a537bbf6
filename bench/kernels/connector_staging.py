"""The vLLM connector's CUDA data path (`workers.vllm_connector.gpu.CudaPagedKV`) on a GPU, against
pinned host<->device copies of the same bytes.

Request: 64 of 1024 blocks of 16 tokens, 32 layers, 8 KV heads x 128, bf16, vLLM's FlashAttention
layout: 128 MiB of KV = 512 per-head payloads of 256 KiB. Measured, in one run:
(a) pinned host<->device copy bandwidth of those bytes (`copy_(non_blocking=True)`, CUDA events);
(b) the staging kernels (gather = `split_heads(block_major=True)`, one launch over all layers;
    scatter = `merge_heads`), `triton.testing.do_bench` medians, beside a device copy;
(c) inside the save path: the gather kernel and its device-to-host copy (CUDA events);
(d) end to end, host clock: save = `gather` to every payload in hand (views of pinned memory);
    load = the payloads (bytes, as the sidecar client returns them) to the blocks in the cache
    (pinned assembly by `copy_threads`, chunked copies up, one scatter, event waited);
(e) the connector's load function (`workers.vllm_connector.load.load_blocks`, what the load
    thread runs) fed by a real sidecar process on loopback (TCP, memory tier) holding the
    request's 512 artifacts: the batch answers read straight into pinned staging and verified
    there, then one `scatter_staged`; beside it the same sidecar's answers alone
    (`get_many_into`), the checksums alone, and the load through `bytes` (the CPU backend's way,
    what the load loop did on CUDA before).
Path throughput is given as a share of the pinned copy bandwidth in the same direction; target
>= 80%. Every path is first checked bit-exact against the PyTorch reference on fresh random KV.

    python3 bench/kernels/connector_staging.py [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton
import triton.testing
import xxhash

from kernels import reference as ref
from kernels.triton import ops as tri
from workers.vllm_connector import gpu
from workers.vllm_connector import load as connector_load
from workers.vllm_connector.client import SidecarClient
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.payload import Payload, payload_of
from workers.vllm_connector.plan import block_keys

REPO = Path(__file__).resolve().parents[2]

L, NB, N, BS, H, D = 32, 1024, 64, 16, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")
REPS = 20
TARGET = 0.80

lines: list[str] = []
failures: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def check(name: str, ok: bool) -> None:
    say(f"check {name}: {'ok' if ok else 'FAIL'}")
    if not ok:
        failures.append(name)


def median_events_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median of `reps` runs of fn timed with CUDA events on the current stream (after 3)."""
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def median_wall_s(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median host seconds of fn from an idle device (after 3 warm-up runs)."""
    times = []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 3:
            times.append(t1 - t0)
    return statistics.median(times)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fa_cache() -> list[torch.Tensor]:
    return [torch.randn(2, NB, BS, H, D, dtype=DT, device=DEV) for _ in range(L)]


SIDECAR = """
import sys
from pathlib import Path
from workers.sidecar.server import SidecarConfig, run_forever
from workers.sidecar.transports import TCP
config = SidecarConfig(worker_id="bench", store_dir=Path(sys.argv[2]), port=int(sys.argv[1]),
                       memory_bytes=1 << 30, ssd_bytes=0)
raise SystemExit(run_forever(config, TCP))
"""


class _NoSidecar(Exception):
    """The sidecar process did not start: section (e) is skipped."""


def start_sidecar(store_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real sidecar process on loopback (TCP transport, memory tier); its URL once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", SIDECAR, str(port), store_dir], cwd=REPO, env=env
    )
    url = f"http://127.0.0.1:{port}"
    probe = SidecarClient(url, timeout_s=2.0)
    deadline = time.monotonic() + 60
    while not probe.health():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sidecar did not start (exit {proc.poll()})")
        time.sleep(0.2)
    probe.close()
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    say(
        f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"triton {triton.__version__}; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    )
    layers = fa_cache()
    kv = CudaPagedKV(layers, timing=True)
    nbytes = N * H * kv.payload_nbytes
    say(
        f"request: {N} blocks x {L} layers x 2 x {BS} x {H} heads x {D}, bf16 = "
        f"{nbytes / 2**20:.0f} MiB"
    )

    # (a) pinned copies of the same bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    h2d_ms = median_events_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h_ms = median_events_ms(lambda: host.copy_(dev, non_blocking=True))
    h2d_bw, d2h_bw = gbs(nbytes, h2d_ms / 1e3), gbs(nbytes, d2h_ms / 1e3)
    say(
        f"(a) pinned H2D {h2d_ms:.3f} ms = {h2d_bw:.1f} GB/s; "
        f"D2H {d2h_ms:.3f} ms = {d2h_bw:.1f} GB/s"
    )

    # correctness: the save path's payloads are the reference's bytes; loads are exact
    ids = torch.randperm(NB)[:N].tolist()
    staged = kv.gather(ids)
    expect = ref.split_heads(kv.paged, ids, block_major=True).reshape(N, H, -1)
    expect_u8 = expect.view(torch.uint8).cpu().numpy()
    check(
        "save payloads = reference split (bit-exact, all heads and blocks)",
        all(
            payload_of(staged, j, i) == memoryview(expect_u8[i, j])
            for i in range(N)
            for j in range(H)
        ),
    )
    payloads: list[list[Payload]] = [
        [bytes(payload_of(staged, j, i)) for j in range(H)] for i in range(N)
    ]
    del staged
    dst_layers = [torch.full_like(t, float("nan")) for t in layers]
    dst = CudaPagedKV(dst_layers)
    dst_ids = torch.randperm(NB)[:N].tolist()

    def poison_dst() -> None:
        """NaN into the destination blocks, so a load that misses any shows."""
        for t in dst_layers:
            t[:, dst_ids] = float("nan")

    def dst_exact() -> bool:
        """The destination blocks hold the source blocks, bit for bit."""
        return all(
            torch.equal(b[:, dst_ids], a[:, ids]) for a, b in zip(layers, dst_layers, strict=True)
        )

    dst.scatter_payloads(payloads, dst_ids)
    check("load into NaN-poisoned blocks = source blocks (bit-exact)", dst_exact())

    # (b) the staging kernels alone
    ids_dev = torch.tensor(ids, device=DEV)
    staging = torch.empty(
        kv.paged.geometry.head_buffer_shape(N, block_major=True), dtype=DT, device=DEV
    )
    gather_ms = float(
        triton.testing.do_bench(
            lambda: tri.split_heads(kv.paged, ids_dev, staging, True), return_mode="median"
        )
    )
    dst_ids_dev = torch.tensor(dst_ids, device=DEV)
    scatter_ms = float(
        triton.testing.do_bench(
            lambda: tri.merge_heads(staging, dst.paged, dst_ids_dev, True), return_mode="median"
        )
    )
    x = torch.empty(nbytes // 2, dtype=DT, device=DEV)
    y = torch.empty_like(x)
    d2d_ms = float(triton.testing.do_bench(lambda: y.copy_(x), return_mode="median"))
    say(
        f"(b) gather kernel {gather_ms:.4f} ms, scatter kernel {scatter_ms:.4f} ms "
        f"(device copy of the same bytes {d2d_ms:.4f} ms; gather = {gather_ms / d2h_ms:.1%} of "
        f"the D2H copy time)"
    )

    # (c) + (d) save path (timing events only in (c))
    plain = CudaPagedKV(layers)

    def save() -> None:
        s = plain.gather(ids)
        for i in range(N):
            for j in range(H):
                payload_of(s, j, i)

    save_s = median_wall_s(save)
    calls, firsts = [], []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = plain.gather(ids)
        t1 = time.perf_counter()
        payload_of(s, 0, 0)
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        firsts.append(t2 - t0)
        del s
    call_ms, first_ms = statistics.median(calls) * 1e3, statistics.median(firsts) * 1e3
    say(
        f"save: gather() returns after {call_ms:.3f} ms (host), first payload after "
        f"{first_ms:.3f} ms, all {N * H} payload views after {save_s * 1e3:.3f} ms"
    )
    kernel_in, copy_in = [], []
    for _ in range(REPS):
        s = kv.gather(ids)
        k_ms, c_ms = s.timings_ms()
        kernel_in.append(k_ms)
        copy_in.append(c_ms)
        del s
    k_med, c_med = statistics.median(kernel_in), statistics.median(copy_in)
    # where gather()'s host time goes: the pinned staging allocation, the ids' trip, the launch
    unit = plain.payload_nbytes
    pin_s = median_wall_s(lambda: plain._host_buffer((N, H, unit)))
    ids_s = median_wall_s(lambda: plain._ids_on_device(ids))
    launch_s = median_wall_s(lambda: tri.split_heads(kv.paged, ids_dev, staging, True))
    say(
        f"gather() host parts: pinned staging alloc {pin_s * 1e3:.3f} ms, ids to device "
        f"{ids_s * 1e3:.3f} ms, kernel launch {launch_s * 1e3:.3f} ms"
    )
    say(
        f"(c) in the save path: gather kernel {k_med:.4f} ms, D2H copy {c_med:.3f} ms "
        f"({gbs(nbytes, c_med / 1e3):.1f} GB/s)"
    )

    def save_bytes() -> None:
        s = plain.gather(ids)
        for i in range(N):
            for j in range(H):
                bytes(payload_of(s, j, i))

    save_bytes_s = median_wall_s(save_bytes, reps=5)
    for chunk_mib in (2, 32, 128):
        other = CudaPagedKV(layers, chunk_bytes=chunk_mib << 20)

        def save_other(kv_: CudaPagedKV = other) -> None:
            s = kv_.gather(ids)
            for i in range(N):
                for j in range(H):
                    payload_of(s, j, i)

        t_s = median_wall_s(save_other)
        say(
            f"(d) save with {chunk_mib:3d} MiB copy chunks: {t_s * 1e3:.3f} ms = "
            f"{gbs(nbytes, t_s) / d2h_bw:.1%} of pinned D2H"
        )
    save_share = gbs(nbytes, save_s) / d2h_bw
    say(
        f"(d) save end to end {save_s * 1e3:.3f} ms = {gbs(nbytes, save_s):.1f} GB/s = "
        f"{save_share:.1%} of pinned D2H (payloads as views, {gpu.CHUNK_BYTES >> 20} MiB copy "
        f"chunks); copying each payload to bytes: "
        f"{save_bytes_s * 1e3:.2f} ms = {gbs(nbytes, save_bytes_s) / d2h_bw:.1%}"
    )

    # host memcpy for context: one core, 128 MiB, into pinned memory
    src_np = np.frombuffer(b"".join(p for row in payloads for p in row), dtype=np.uint8)
    dst_np = host.numpy()
    memcpy_s = median_wall_s(lambda: np.copyto(dst_np, src_np), reps=5)
    say(f"host memcpy, one thread, into pinned: {gbs(nbytes, memcpy_s):.1f} GB/s")

    # (d) load path, by copy threads and chunk size
    results: list[tuple[int, int, float]] = []
    for threads in (1, 2, 4, 8):
        for chunk_mib in (2, 8, 32):
            load_kv = CudaPagedKV(dst_layers, copy_threads=threads, chunk_bytes=chunk_mib << 20)
            poison_dst()
            load_kv.scatter_payloads(payloads, dst_ids)
            check(f"load threads={threads} chunk={chunk_mib} MiB exact", dst_exact())
            t_s = median_wall_s(partial(load_kv.scatter_payloads, payloads, dst_ids), reps=10)
            load_kv.close()
            results.append((threads, chunk_mib, t_s))
            say(
                f"(d) load threads={threads} chunk={chunk_mib:2d} MiB: {t_s * 1e3:.3f} ms = "
                f"{gbs(nbytes, t_s):.1f} GB/s = {gbs(nbytes, t_s) / h2d_bw:.1%} of pinned H2D"
            )
    # (d) load from payloads already in pinned slots (read there by SidecarClient.get_into)
    slots_kv = CudaPagedKV(dst_layers)
    staging_in = slots_kv.load_staging(N)
    for i in range(N):
        for j in range(H):
            staging_in.slot(i, j)[:] = payloads[i][j]
    poison_dst()
    slots_kv.scatter_staged(staging_in, dst_ids)
    check("load from pinned slots exact", dst_exact())
    slots_s = median_wall_s(partial(slots_kv.scatter_staged, staging_in, dst_ids))
    slots_share = gbs(nbytes, slots_s) / h2d_bw
    say(
        f"(d) load from pinned slots: {slots_s * 1e3:.3f} ms = {gbs(nbytes, slots_s):.1f} GB/s "
        f"= {slots_share:.1%} of pinned H2D"
    )
    # (e) the connector's load function, fed by a real sidecar on loopback
    conn_s = answer_s = hash_s = bytes_s = float("nan")
    with tempfile.TemporaryDirectory() as store_dir:
        try:
            proc, url = start_sidecar(store_dir)
        except RuntimeError as exc:  # the rows above still come out
            check(f"sidecar on loopback started ({exc})", False)
            proc = None
        try:
            if proc is None:
                raise _NoSidecar
            client = SidecarClient(url, timeout_s=120.0)
            heads = tuple(range(H))
            rows = [block_keys("bench", 0x1000 + i, heads) for i in range(N)]
            client.put_many(
                [(key, payloads[i][j]) for i, row in enumerate(rows) for j, key in enumerate(row)],
                H,
            )
            conn_kv = CudaPagedKV(dst_layers)
            poison_dst()
            outcome = connector_load.load_blocks(client, conn_kv, rows, dst_ids)
            check(
                "connector load from the sidecar exact (all blocks, pinned staging)",
                outcome.blocks == N and outcome.refused is None and dst_exact(),
            )
            conn_s = median_wall_s(
                partial(connector_load.load_blocks, client, conn_kv, rows, dst_ids), reps=10
            )
            keys = [k for row in rows for k in row]
            answer_staging = conn_kv.load_staging(N)
            answer_slots = [answer_staging.slot(i, j) for i in range(N) for j in range(H)]
            answer_s = median_wall_s(partial(client.get_many_into, keys, answer_slots), reps=10)
            hash_s = median_wall_s(
                lambda: [xxhash.xxh3_128_hexdigest(slot) for slot in answer_slots], reps=10
            )
            poison_dst()
            old = connector_load._load_bytes(client, conn_kv, rows, dst_ids)
            check("connector load through bytes exact", old.blocks == N and dst_exact())
            bytes_s = median_wall_s(
                partial(connector_load._load_bytes, client, conn_kv, rows, dst_ids), reps=5
            )
            conn_kv.close()
            client.close()
        except _NoSidecar:
            pass
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    conn_share = gbs(nbytes, conn_s) / h2d_bw
    say(
        f"(e) connector load_blocks from a sidecar on loopback: {conn_s * 1e3:.3f} ms = "
        f"{gbs(nbytes, conn_s):.1f} GB/s = {conn_share:.1%} of pinned H2D; the sidecar's "
        f"answers alone (get_many_into, verified) {answer_s * 1e3:.3f} ms = "
        f"{gbs(nbytes, answer_s):.1f} GB/s; checksums alone {hash_s * 1e3:.3f} ms = "
        f"{gbs(nbytes, hash_s):.1f} GB/s; through bytes (before) {bytes_s * 1e3:.3f} ms = "
        f"{gbs(nbytes, bytes_s) / h2d_bw:.1%}"
    )
    best = min(results, key=lambda r: r[2])
    load_default = next(
        t for th, ch, t in results if th == gpu.COPY_THREADS and ch << 20 == gpu.CHUNK_BYTES
    )
    load_share = gbs(nbytes, load_default) / h2d_bw

    summary = [
        "",
        "| what | ms | GB/s | share of pinned copy bw | target >= 80% |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| pinned H2D copy, {nbytes >> 20} MiB | {h2d_ms:.3f} | {h2d_bw:.1f} | 100% | |",
        f"| pinned D2H copy, {nbytes >> 20} MiB | {d2h_ms:.3f} | {d2h_bw:.1f} | 100% | |",
        f"| gather kernel (one launch, 32 layers) | {gather_ms:.4f} | "
        f"{gbs(nbytes, gather_ms / 1e3):.0f} | | |",
        f"| scatter kernel (one launch) | {scatter_ms:.4f} | "
        f"{gbs(nbytes, scatter_ms / 1e3):.0f} | | |",
        f"| save path: gather launch + kernel (events) | {k_med:.4f} | | | |",
        f"| save path: D2H copy (events) | {c_med:.3f} | {gbs(nbytes, c_med / 1e3):.1f} | "
        f"{gbs(nbytes, c_med / 1e3) / d2h_bw:.1%} | |",
        f"| save end to end (payload views in hand) | {save_s * 1e3:.3f} | "
        f"{gbs(nbytes, save_s):.1f} | "
        f"{save_share:.1%} | {'met' if save_share >= TARGET else 'NOT met'} |",
        f"| save, each payload copied to bytes | {save_bytes_s * 1e3:.2f} | "
        f"{gbs(nbytes, save_bytes_s):.1f} | {gbs(nbytes, save_bytes_s) / d2h_bw:.1%} | |",
        f"| load end to end (defaults: {gpu.COPY_THREADS} threads, "
        f"{gpu.CHUNK_BYTES >> 20} MiB chunks) | {load_default * 1e3:.3f} | "
        f"{gbs(nbytes, load_default):.1f} | {load_share:.1%} | "
        f"{'met' if load_share >= TARGET else 'NOT met'} |",
        f"| load, best ({best[0]} threads, {best[1]} MiB chunks) | {best[2] * 1e3:.3f} | "
        f"{gbs(nbytes, best[2]):.1f} | {gbs(nbytes, best[2]) / h2d_bw:.1%} | |",
        f"| load end to end from pinned slots (`get_into` + `scatter_staged`) | "
        f"{slots_s * 1e3:.3f} | {gbs(nbytes, slots_s):.1f} | {slots_share:.1%} | "
        f"{'met' if slots_share >= TARGET else 'NOT met'} |",
        f"| connector `load_blocks` fed by a sidecar on loopback (batch answers read into "
        f"pinned slots, verified, one `scatter_staged`) | {conn_s * 1e3:.3f} | "
        f"{gbs(nbytes, conn_s):.1f} | {conn_share:.1%} | "
        f"{'met' if conn_share >= TARGET else 'NOT met'} |",
        f"| of it: the sidecar's answers into pinned slots, verified (`get_many_into`) | "
        f"{answer_s * 1e3:.3f} | {gbs(nbytes, answer_s):.1f} | "
        f"{gbs(nbytes, answer_s) / h2d_bw:.1%} | |",
        f"| of it: XXH3-128 of the 512 slots, one thread | {hash_s * 1e3:.3f} | "
        f"{gbs(nbytes, hash_s):.1f} | | |",
        f"| the same sidecar load through `bytes` (`get_many` + `scatter_payloads`, before) | "
        f"{bytes_s * 1e3:.3f} | {gbs(nbytes, bytes_s):.1f} | "
        f"{gbs(nbytes, bytes_s) / h2d_bw:.1%} | |",
        f"| host memcpy into pinned, one thread | {memcpy_s * 1e3:.2f} | "
        f"{gbs(nbytes, memcpy_s):.1f} | | |",
        "",
        "checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)),
    ]
    for row in summary:
        say(row)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
