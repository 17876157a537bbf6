"""Check every KV data-movement kernel against its PyTorch reference on a CUDA GPU, then time it
against a device-to-device copy of the same bytes in the same run.

Shape: 32 layers, 256 of 4096 blocks, block 16, 8 KV heads, head dim 128, bf16; RoPE re-rotation
of 4096 tokens x 32 layers x 8 heads x 128. Inputs are fresh random normals for every check,
outputs are poisoned with NaN before each checked run. Timing: triton.testing.do_bench (CUDA
events, L2 flushed between runs, warmup, median).

    python bench/kernels/gpu_check.py [--sweep | --sweep-rope] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton
import triton.testing

import kernels
from kernels import reference as ref
from kernels.layouts import PagedKV
from kernels.triton import ops as tri

L, NB, N, BS, H, D = 32, 4096, 256, 16, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")
MLA_D = 576

rows: list[dict[str, object]] = []
failures: list[str] = []


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn, CUDA events, L2 flushed before each run."""
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


_copy_ms: dict[int, float] = {}


def copy_ms(nbytes: int) -> float:
    """Device-to-device copy of nbytes (read nbytes, write nbytes), measured once per size."""
    if nbytes not in _copy_ms:
        a = torch.randn(nbytes // 2, dtype=DT, device=DEV)
        b = torch.empty_like(a)
        _copy_ms[nbytes] = bench(lambda: b.copy_(a))
        del a, b
    return _copy_ms[nbytes]


def record(name: str, nbytes: int, fast: Callable[[], object], naive: Callable[[], object]) -> None:
    t_fast, t_naive, t_copy = bench(fast), bench(naive), copy_ms(nbytes)
    rows.append(
        {
            "kernel": name,
            "MiB": nbytes / 2**20,
            "copy_ms": t_copy,
            "triton_ms": t_fast,
            "naive_ms": t_naive,
            "triton_frac": t_copy / t_fast,
            "naive_frac": t_copy / t_naive,
            "x_floor": t_fast / t_copy,
        }
    )
    print(
        f"{name:34s} copy {t_copy:.4f} ms  triton {t_fast:.4f} ms ({t_copy / t_fast:6.1%})  "
        f"naive {t_naive:.4f} ms ({t_copy / t_naive:6.1%})",
        flush=True,
    )


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"check {name:40s} {'ok' if ok else 'FAIL'} {detail}", flush=True)
    if not ok:
        failures.append(f"{name} {detail}")


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT, device=DEV)


def block_ids(n: int = N, nb: int = NB) -> torch.Tensor:
    return torch.randperm(nb, device=DEV)[:n].contiguous()


# ----- layouts at the benchmark shape: build (paged, clone maker) -----


def make_vllm() -> tuple[PagedKV, list[torch.Tensor]]:
    t = [rand(2, NB, BS, H, D) for _ in range(L)]
    return kernels.vllm_kv(t), t


def make_sglang() -> tuple[PagedKV, list[torch.Tensor]]:
    k = [rand(NB * BS, H, D) for _ in range(L)]
    v = [rand(NB * BS, H, D) for _ in range(L)]
    return kernels.sglang_kv(k, v, BS), k + v


def make_trtllm() -> tuple[PagedKV, list[torch.Tensor]]:
    pool = rand(NB, L, 2, H, BS, D)
    return kernels.trtllm_kv(pool), [pool]


def make_vllm_mla() -> tuple[PagedKV, list[torch.Tensor]]:
    t = [rand(NB, BS, MLA_D) for _ in range(L)]
    return kernels.vllm_kv(t, mla=True), t


def rebuild(name: str, tensors: list[torch.Tensor]) -> PagedKV:
    if name == "vllm":
        return kernels.vllm_kv(tensors)
    if name == "sglang":
        return kernels.sglang_kv(tensors[:L], tensors[L:], BS)
    if name == "trtllm":
        return kernels.trtllm_kv(tensors[0])
    return kernels.vllm_kv(tensors, mla=True)


MAKERS = {
    "vllm": make_vllm,
    "sglang": make_sglang,
    "trtllm": make_trtllm,
    "vllm-mla": make_vllm_mla,
}


def poison_blocks(paged: PagedKV, ids: torch.Tensor) -> None:
    for v in paged.views:
        v[ids] = float("nan")


def same(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool = True) -> tuple[bool, str]:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if torch.isnan(x).any() or torch.isnan(y).any():
            return False, "NaN left (unwritten output)"
        if exact:
            if not torch.equal(x, y):
                return False, "mismatch"
        else:
            rel = ((x.float() - y.float()).norm() / y.float().norm()).item()
            worst = max(worst, rel)
    return (worst < 1e-2), f"rel err {worst:.2e}" if not exact else ""


def check_layout(name: str) -> None:
    paged, tensors = MAKERS[name]()
    g = paged.geometry
    ids = block_ids()
    # gather: poisoned staging, exact match with the reference
    out = torch.full(g.staging_shape(N), float("nan"), dtype=DT, device=DEV)
    tri.gather_blocks(paged, ids, out)
    check(f"{name} gather", *same([out], [ref.gather_blocks(paged, ids)]))
    # scatter: fresh staging into poisoned destination blocks; untouched blocks must not change
    staging = rand(*g.staging_shape(N))
    ids2 = block_ids()
    poison_blocks(paged, ids2)
    copies = [t.clone() for t in tensors]
    tri.scatter_blocks(staging, paged, ids2)
    ref.scatter_blocks(staging, rebuild(name, copies), ids2)
    check(f"{name} scatter", *same(tensors, copies))
    record(
        f"{name} gather",
        out.numel() * 2,
        lambda: tri.gather_blocks(paged, ids, out),
        lambda: ref.gather_blocks(paged, ids, out),
    )
    record(
        f"{name} scatter",
        staging.numel() * 2,
        lambda: tri.scatter_blocks(staging, paged, ids2),
        lambda: ref.scatter_blocks(staging, paged, ids2),
    )


def check_heads() -> None:
    # a TP rank holding 8 KV heads, vLLM layout: split to per-head buffers and merge back
    paged, tensors = make_vllm()
    g = paged.geometry
    ids = block_ids()
    out = torch.full(g.head_buffer_shape(N), float("nan"), dtype=DT, device=DEV)
    tri.split_heads(paged, ids, out)
    check("vllm split_heads", *same([out], [ref.split_heads(paged, ids)]))
    bufs = rand(*g.head_buffer_shape(N))
    ids2 = block_ids()
    poison_blocks(paged, ids2)
    copies = [t.clone() for t in tensors]
    tri.merge_heads(bufs, paged, ids2)
    ref.merge_heads(bufs, kernels.vllm_kv(copies), ids2)
    check("vllm merge_heads", *same(tensors, copies))
    record(
        "vllm split_heads (8 heads)",
        out.numel() * 2,
        lambda: tri.split_heads(paged, ids, out),
        lambda: ref.split_heads(paged, ids, out),
    )
    record(
        "vllm merge_heads (8 heads)",
        bufs.numel() * 2,
        lambda: tri.merge_heads(bufs, paged, ids2),
        lambda: ref.merge_heads(bufs, paged, ids2),
    )
    # TP=4 producer -> TP=2 and TP=8 consumers at a smaller shape: exactness across TP sizes
    tp_check()


def tp_check() -> None:
    nb, n, total = 64, 16, 8
    full = [rand(2, nb, BS, total, D) for _ in range(4)]
    ids = block_ids(n, nb)
    per_head: dict[int, torch.Tensor] = {}
    for r in range(4):
        heads = kernels.rank_kv_heads(total, 4, r)
        rank_kv = kernels.vllm_kv([t[:, :, :, heads.start : heads.stop].contiguous() for t in full])
        bufs = tri.split_heads(rank_kv, ids)
        for j, hg in enumerate(heads):
            per_head[hg] = bufs[j]
    ok = True
    for tp in (2, 8):
        for r in range(tp):
            heads = kernels.rank_kv_heads(total, tp, r)
            dst = [
                torch.full((2, nb, BS, len(heads), D), float("nan"), dtype=DT, device=DEV)
                for _ in range(4)
            ]
            bufs = torch.stack([per_head[hg] for hg in heads])
            tri.merge_heads(bufs, kernels.vllm_kv(dst), ids)
            for t, x in zip(full, dst, strict=True):
                ok &= torch.equal(x[:, ids], t[:, ids, :, heads.start : heads.stop])
    check("split TP=4 -> merge TP=2 and TP=8", ok)


def check_rope(neox: bool) -> None:
    # 4096 tokens = 256 blocks of 16, K of 32 layers x 8 heads x 128 re-rotated in place
    style = "neox" if neox else "gptj"
    spec = kernels.RopeSpec(D, neox=neox)
    paged, tensors = make_vllm()
    ids = block_ids()
    delta = torch.randint(-4000, 4000, (N * BS,), device=DEV).float()
    copies = [t.clone() for t in tensors]
    tri.rerotate_blocks(paged, ids, spec, delta)
    ref.rerotate_blocks(kernels.vllm_kv(copies), ids, spec, delta)
    check(f"rerotate in place ({style})", *same(tensors, copies, exact=False))
    # exact-V, rotated-K scatter from staging into poisoned destination blocks
    staging = rand(*paged.geometry.staging_shape(N))
    poison_blocks(paged, ids)
    copies = [t.clone() for t in tensors]
    tri.scatter_blocks(staging, paged, ids, rope=spec, delta=delta)
    ref.scatter_blocks(staging, kernels.vllm_kv(copies), ids, rope=spec, delta=delta)
    check(f"scatter + rerotate ({style})", *same(tensors, copies, exact=False))
    # one delta for the whole chunk (chunk reuse's case): a kernel argument, no per-token table
    copies = [t.clone() for t in tensors]
    tri.rerotate_blocks(paged, ids, spec, -2345)
    ref.rerotate_blocks(kernels.vllm_kv(copies), ids, spec, -2345)
    check(f"rerotate in place ({style}, one delta)", *same(tensors, copies, exact=False))
    k_bytes = N * BS * L * H * D * 2
    record(
        f"rerotate K in place ({style}, per-token delta)",
        k_bytes,
        lambda: tri.rerotate_blocks(paged, ids, spec, delta),
        lambda: ref.rerotate_blocks(paged, ids, spec, delta),
    )
    record(
        f"rerotate K in place ({style}, one delta)",
        k_bytes,
        lambda: tri.rerotate_blocks(paged, ids, spec, 1234),
        lambda: ref.rerotate_blocks(paged, ids, spec, 1234),
    )
    record(
        f"scatter + rerotate K ({style}, per-token delta)",
        2 * k_bytes,
        lambda: tri.scatter_blocks(staging, paged, ids, rope=spec, delta=delta),
        lambda: ref.scatter_blocks(staging, paged, ids, rope=spec, delta=delta),
    )


def sweep() -> None:
    """Time launch-parameter variants of the flat copy and the RoPE kernel (tuning notes)."""
    paged, _ = make_vllm()
    ids = block_ids()
    out = torch.empty(paged.geometry.staging_shape(N), dtype=DT, device=DEV)
    base = copy_ms(out.numel() * 2)
    for tile in (1024, 2048, 4096, 8192, 16384):
        for warps in (2, 4, 8):
            tri.FLAT_TILE, tri.NUM_WARPS = tile, warps
            t = bench(lambda: tri.gather_blocks(paged, ids, out))
            print(f"sweep gather tile={tile:5d} warps={warps}: {t:.4f} ms ({base / t:6.1%})")
    tri.FLAT_TILE, tri.NUM_WARPS = 4096, 4
    sweep_rope(paged, ids)


def sweep_rope(paged: PagedKV, ids: torch.Tensor) -> None:
    """Time the re-rotation kernel's launch parameters, in place and fused with a scatter."""
    delta = torch.full((N * BS,), 1234.0, device=DEV)
    staging = rand(*paged.geometry.staging_shape(N))
    k_floor = copy_ms(N * BS * L * H * D * 2)
    kv_floor = copy_ms(staging.numel() * 2)
    defaults = (tri.ROPE_TOKENS, tri.ROPE_LPP, tri.ROPE_WARPS, tri.ROPE_STAGES)
    for neox in (True, False):
        spec = kernels.RopeSpec(D, neox=neox)
        for tokens in (8, 16):
            for lpp in (1, 2):
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        tri.ROPE_TOKENS, tri.ROPE_LPP = tokens, lpp
                        tri.ROPE_WARPS, tri.ROPE_STAGES = warps, stages
                        t1 = bench(lambda: tri.rerotate_blocks(paged, ids, spec, delta))  # noqa: B023
                        t2 = bench(
                            lambda: tri.scatter_blocks(staging, paged, ids, rope=spec, delta=delta)  # noqa: B023
                        )
                        print(
                            f"sweep rope {'neox' if neox else 'gptj'} tokens={tokens:2d} "
                            f"lpp={lpp} warps={warps} stages={stages}: in place {t1:.4f} ms "
                            f"({t1 / k_floor:.2f}x), fused {t2:.4f} ms ({t2 / kv_floor:.2f}x)"
                        )
    tri.ROPE_TOKENS, tri.ROPE_LPP, tri.ROPE_WARPS, tri.ROPE_STAGES = defaults


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="tune the copy and RoPE kernels")
    ap.add_argument("--sweep-rope", action="store_true", help="tune the RoPE kernel only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}, {props.multi_processor_count} SMs"
    print(f"device: {device}; torch {torch.__version__}; triton {triton.__version__}")
    big = N * L * 2 * BS * H * D * 2
    gbs = 2 * big / copy_ms(big) / 1e6
    print(f"copy {big / 2**20:.0f} MiB: {copy_ms(big):.4f} ms = {gbs:.0f} GB/s (read + write)")
    if args.sweep:
        sweep()
    elif args.sweep_rope:
        paged, _ = make_vllm()
        sweep_rope(paged, block_ids())
        del paged
        torch.cuda.empty_cache()
    for name in MAKERS:
        check_layout(name)
        torch.cuda.empty_cache()
    check_heads()
    torch.cuda.empty_cache()
    for neox in (True, False):
        check_rope(neox)
        torch.cuda.empty_cache()
    lines = [
        f"device: {device}; torch {torch.__version__}; triton {triton.__version__}; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "| kernel | MiB moved (each way) | d2d copy ms | triton ms | triton / copy bw | naive ms "
        "| naive / copy bw | triton x floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['MiB']:.0f} | {r['copy_ms']:.4f} | {r['triton_ms']:.4f} | "
            f"{r['triton_frac']:.1%} | {r['naive_ms']:.4f} | {r['naive_frac']:.1%} | "
            f"{r['x_floor']:.2f} |"
        )
    lines.append("")
    lines.append("checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
