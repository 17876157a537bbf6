"""Triton kernels behind `workers.vllm_connector.gpu_digest` (the keyed-MAC digest of
`workers.mooncake_store.digest`): per-slice lane sums while copying the words, then the sums
added with the key terms and written or checked. Imported only through `gpu_digest`;
decorated at import, so `TRITON_INTERPRET=1` must be set before this module is (re)loaded to
run it on the interpreter."""

# mypy: disable-error-code="no-untyped-def"
# Triton kernels take untyped pointer / constexpr parameters by design.

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mac_partials_kernel(
    src, src_row, dst, dst_row, partial, words, per, slices,
    gamma, seed0, seed1, mix1, mix2,
    BLOCK: tl.constexpr, COPY: tl.constexpr = True,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    acc0 = tl.zeros([BLOCK], dtype=tl.uint64)
    acc1 = tl.zeros([BLOCK], dtype=tl.uint64)
    gamma = gamma.to(tl.uint64, bitcast=True)
    seed0 = seed0.to(tl.uint64, bitcast=True)
    seed1 = seed1.to(tl.uint64, bitcast=True)
    mix1 = mix1.to(tl.uint64, bitcast=True)
    mix2 = mix2.to(tl.uint64, bitcast=True)
    start = part * per
    for off in range(start, start + per, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        live = idx < words
        w = tl.load(src + row * src_row + idx, mask=live, other=0)
        if COPY:
            tl.store(dst + row * dst_row + idx, w, mask=live)
        wu = w.to(tl.uint64, bitcast=True)
        i = (idx + 1).to(tl.uint64)
        z = seed0 + i * gamma
        z = (z ^ (z >> 30)) * mix1
        z = (z ^ (z >> 27)) * mix2
        acc0 += wu * ((z ^ (z >> 31)) | 1)
        z = seed1 + i * gamma
        z = (z ^ (z >> 30)) * mix1
        z = (z ^ (z >> 27)) * mix2
        acc1 += wu * ((z ^ (z >> 31)) | 1)
    at = partial + (row * slices + part) * 2
    tl.store(at, tl.sum(acc0, axis=0).to(tl.int64, bitcast=True))
    tl.store(at + 1, tl.sum(acc1, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def mac_finish_kernel(
    partial, slices, lanes, digest, digest_row, ok, lane1_mask, tag,
    VERIFY: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    live = j < slices
    at = partial + (row * slices + j) * 2
    p0 = tl.load(at, mask=live, other=0).to(tl.uint64, bitcast=True)
    p1 = tl.load(at + 1, mask=live, other=0).to(tl.uint64, bitcast=True)
    k0 = tl.load(lanes + row * 2).to(tl.uint64, bitcast=True)
    k1 = tl.load(lanes + row * 2 + 1).to(tl.uint64, bitcast=True)
    lane0 = tl.sum(p0, axis=0) + k0
    mask = lane1_mask.to(tl.uint64, bitcast=True)
    lane1 = ((tl.sum(p1, axis=0) + k1) & mask) | tag.to(tl.uint64, bitcast=True)
    at = digest + row * digest_row
    if VERIFY:
        d0 = tl.load(at).to(tl.uint64, bitcast=True)
        d1 = tl.load(at + 1).to(tl.uint64, bitcast=True)
        tl.store(ok + row, ((d0 == lane0) & (d1 == lane1)).to(tl.int32))
    else:
        tl.store(at, lane0.to(tl.int64, bitcast=True))
        tl.store(at + 1, lane1.to(tl.int64, bitcast=True))
