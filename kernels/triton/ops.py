"""Triton implementations of the KV data-movement kernels, same signatures and meaning as
`kernels.reference`: each call is one kernel launch over all blocks, layers and sides.

Runs on CUDA tensors, or on CPU tensors when `TRITON_INTERPRET=1` was set before `kernels.triton`
was imported (tests). Block ids must be distinct on the written side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.checks import buffer_for, paired_ids, rerotation_ids
from kernels.layouts import BlockIds, KVGeometry, LayoutError, PagedKV
from kernels.rope import RopeSpec, token_deltas
from kernels.triton import _jit

_VEC_BYTES = 16
FLAT_TILE = 4096  # elements per program in the flat copy
ROW_TILE = 4096  # rows * padded head_dim per program in the row copy
NUM_WARPS = 4
ROPE_TOKENS = 8  # tokens per re-rotation program; their cos/sin serve all its heads and layers
ROPE_LPP = 1  # layers per re-rotation program
ROPE_WARPS = 4
ROPE_STAGES = 3  # software-pipelining stages of the re-rotation head loop


@dataclass(frozen=True, slots=True)
class _Side:
    """One end of a chunk copy, in elements: see `kernels.triton._jit`."""

    base: torch.Tensor
    tab: torch.Tensor | None
    lk_stride: int
    ids: torch.Tensor | None
    bstride: int
    tstride: int
    hstride: int
    aligned: bool

    def strides_ok(self, align: int) -> bool:
        return all(
            s % align == 0 for s in (self.lk_stride, self.bstride, self.tstride, self.hstride)
        )


def _paged_side(paged: PagedKV, ids: torch.Tensor, kv: int | None = None) -> _Side:
    v = paged.views[0]
    return _Side(
        base=v,
        tab=paged.offset_table(kv),
        lk_stride=0,
        ids=ids,
        bstride=v.stride(0),
        tstride=v.stride(1),
        hstride=v.stride(2),
        aligned=paged.aligned(_VEC_BYTES),
    )


def _staging_side(staging: torch.Tensor, paged: PagedKV) -> _Side:
    g = paged.geometry
    c = g.chunk_elems
    return _Side(
        base=staging,
        tab=None,
        lk_stride=c,
        ids=None,
        bstride=g.num_layers * g.kv_factor * c,
        tstride=g.num_kv_heads * g.head_dim,
        hstride=g.head_dim,
        aligned=staging.data_ptr() % _VEC_BYTES == 0,
    )


def _head_side(buf: torch.Tensor, paged: PagedKV, n: int, block_major: bool) -> _Side:
    g = paged.geometry
    unit = g.block_size * g.head_dim
    per_unit = g.num_layers * g.kv_factor * unit  # one (head, block) artifact
    return _Side(
        base=buf,
        tab=None,
        lk_stride=unit,
        ids=None,
        bstride=g.num_kv_heads * per_unit if block_major else per_unit,
        tstride=g.head_dim,
        hstride=per_unit if block_major else n * per_unit,
        aligned=buf.data_ptr() % _VEC_BYTES == 0,
    )


def _align(src: _Side, dst: _Side) -> int:
    """Elements per 16-byte vector when both sides provably allow 16-byte accesses, else 1."""
    esize = src.base.element_size()
    align = _VEC_BYTES // esize if _VEC_BYTES % esize == 0 else 1
    if (
        align > 1
        and src.aligned
        and dst.aligned
        and src.strides_ok(align)
        and dst.strides_ok(align)
    ):
        return align
    return 1


def _tab(side: _Side) -> torch.Tensor:
    return side.tab if side.tab is not None else side.base


def _ids(side: _Side) -> torch.Tensor:
    return side.ids if side.ids is not None else side.base


def _launch(
    src: _Side,
    dst: _Side,
    paged: PagedKV,
    n: int,
    lk: int,
    kvf: int,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Copy n blocks x lk layer-kv chunks from src to dst; with rope, K (lk % kvf == 0) is
    re-rotated by `delta` (one int, or one value per token) and V (kvf == 2) copied; with
    `gate` (flags, group of each block), a block moves only where its prefix of flags is set
    (the row copy)."""
    if n == 0:
        return
    if rope is not None:
        _launch_rope(src, dst, paged, n, lk // kvf, kvf, rope, delta, inv_freq)
        return
    g = paged.geometry
    h, d = g.num_kv_heads, g.head_dim
    align = _align(src, dst)
    # One head: its stride is never used, so per-head buffers of MLA copy flat too.
    flat_ok = all(s.tstride == h * d and (h == 1 or s.hstride == d) for s in (src, dst))
    if flat_ok and gate is None:
        chunk = g.chunk_elems
        tile = min(FLAT_TILE, triton.next_power_of_2(chunk))
        flat_grid = (n * lk, triton.cdiv(chunk, tile))
        _jit.copy_flat_kernel[flat_grid](
            src.base, _tab(src), src.lk_stride, _ids(src), src.bstride,
            dst.base, _tab(dst), dst.lk_stride, _ids(dst), dst.bstride,
            lk, chunk,
            SRC_TAB=src.tab is not None, SRC_IDS=src.ids is not None,
            DST_TAB=dst.tab is not None, DST_IDS=dst.ids is not None,
            TILE=tile, EVEN=chunk % tile == 0, ALIGN=align,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        return
    dp = triton.next_power_of_2(d)
    rows_total = g.block_size * h
    rows = max(1, min(triton.next_power_of_2(rows_total), ROW_TILE // dp))
    grid = (n, triton.cdiv(rows_total, rows), lk // kvf)
    _jit.copy_rows_kernel[grid](
        src.base, _tab(src), src.lk_stride, _ids(src), src.bstride, src.tstride, src.hstride,
        dst.base, _tab(dst), dst.lk_stride, _ids(dst), dst.bstride, dst.tstride, dst.hstride,
        h, rows_total, d,
        gate[0] if gate is not None else dst.base, gate[1] if gate is not None else dst.base,
        SRC_TAB=src.tab is not None, SRC_IDS=src.ids is not None,
        DST_TAB=dst.tab is not None, DST_IDS=dst.ids is not None,
        ROWS=rows, DP=dp, LPP=kvf, ALIGN=align, GATE=gate is not None,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def _launch_rope(
    src: _Side,
    dst: _Side,
    paged: PagedKV,
    n: int,
    layers: int,
    kvf: int,
    rope: RopeSpec,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor | None,
) -> None:
    """K of `layers` layers re-rotated from src to dst (in place when they are the same side);
    V copied too when kvf == 2."""
    g = paged.geometry
    h, d = g.num_kv_heads, g.head_dim
    if rope.head_dim != d:
        raise LayoutError(f"RopeSpec head_dim {rope.head_dim} != KV head_dim {d}")
    align = _align(src, dst)
    dp = triton.next_power_of_2(d)
    r = rope.rot_dim
    half, half_p2, rest_p2 = r // 2, 1, 0
    if rope.neox:
        mode = 2
        half_p2 = triton.next_power_of_2(half)
        rest_p2 = triton.next_power_of_2(d - r) if d > r else 0
        pad = half
    else:
        if dp != d or src.base.element_size() != 2 or align == 1:
            raise LayoutError(
                "GPT-J re-rotation in Triton needs a 2-byte dtype, a power-of-two head_dim and "
                "16-byte aligned rows; use backend='reference'"
            )
        mode = 1
        pad = d // 2
    if inv_freq is None:
        freq = _freq_table(rope, paged.device, pad)
    else:
        f = inv_freq.to(device=paged.device, dtype=torch.float32).reshape(-1)
        freq = torch.cat((f, f.new_zeros(pad - f.numel()))) if f.numel() < pad else f.contiguous()
    if isinstance(delta, torch.Tensor):
        deltas = token_deltas(delta, n * g.block_size, paged.device).contiguous()
        delta0 = 0.0
    else:
        deltas, delta0 = freq, float(delta)
    tt = min(ROPE_TOKENS, triton.next_power_of_2(g.block_size))
    lpp = max(1, min(ROPE_LPP, layers))
    while layers % lpp:
        lpp -= 1
    grid = (n, triton.cdiv(g.block_size, tt), layers // lpp)
    _jit.rope_kernel[grid](
        src.base, _tab(src), src.lk_stride, _ids(src), src.bstride, src.tstride, src.hstride,
        dst.base, _tab(dst), dst.lk_stride, _ids(dst), dst.bstride, dst.tstride, dst.hstride,
        freq, deltas, delta0,
        g.block_size, d,
        SRC_TAB=src.tab is not None, SRC_IDS=src.ids is not None,
        DST_TAB=dst.tab is not None, DST_IDS=dst.ids is not None,
        TT=tt, LPP=lpp, KVF=kvf, COPY_V=kvf == 2, MODE=mode, DELTA_TAB=deltas is not freq,
        HALF=half, HALF_P2=half_p2, REST_P2=rest_p2, DP=dp, H=h, STAGES=ROPE_STAGES, ALIGN=align,
        num_warps=ROPE_WARPS,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _freq_table(rope: RopeSpec, device: torch.device, length: int) -> torch.Tensor:
    """`rope.inv_freq` on `device`, zero-padded to `length` (angle 0 leaves a pair unrotated);
    cached so that a call launches nothing but the kernel."""
    f = rope.inv_freq(device)
    return torch.cat((f, f.new_zeros(length - f.numel()))) if f.numel() < length else f


def _check_rope(rope: RopeSpec | None, g: KVGeometry) -> None:
    """Re-rotating on the way needs a K to rotate: a K/V cache, not MLA's latent."""
    if rope is not None and g.kv_factor != 2:
        raise LayoutError("re-rotation needs a K/V cache")


def _lk(paged: PagedKV) -> int:
    return paged.geometry.num_layers * paged.geometry.kv_factor


def gather_blocks(
    paged: PagedKV, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """See `kernels.reference.gather_blocks`."""
    g = paged.geometry
    ids, out = buffer_for(paged, block_ids, out, per_head=False)
    n = ids.numel()
    _launch(_paged_side(paged, ids), _staging_side(out, paged), paged, n, _lk(paged), g.kv_factor)
    return out


def scatter_blocks(
    staging: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """See `kernels.reference.scatter_blocks`."""
    g = paged.geometry
    ids, _ = buffer_for(paged, block_ids, staging, per_head=False)
    _check_rope(rope, g)
    src, dst = _staging_side(staging, paged), _paged_side(paged, ids)
    _launch(src, dst, paged, ids.numel(), _lk(paged), g.kv_factor, rope, delta, inv_freq)


def copy_blocks(
    src: PagedKV,
    dst: PagedKV,
    src_ids: BlockIds,
    dst_ids: BlockIds,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """See `kernels.reference.copy_blocks`."""
    gs, gd = src.geometry, dst.geometry
    same = (gs.num_layers, gs.kv_factor, gs.block_size, gs.num_kv_heads, gs.head_dim, gs.dtype)
    if same != (gd.num_layers, gd.kv_factor, gd.block_size, gd.num_kv_heads, gd.head_dim, gd.dtype):
        raise LayoutError("copy_blocks needs the same geometry and dtype on both sides")
    if src.device != dst.device:
        raise LayoutError("copy_blocks needs both caches on one device")
    sids, dids = paired_ids(src, dst, src_ids, dst_ids)
    _check_rope(rope, gs)
    s, d = _paged_side(src, sids), _paged_side(dst, dids)
    _launch(s, d, dst, sids.numel(), _lk(dst), gs.kv_factor, rope, delta, inv_freq)


def rerotate_blocks(
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """See `kernels.reference.rerotate_blocks`: K only, in place."""
    ids = rerotation_ids(paged, block_ids)
    side = _paged_side(paged, ids, kv=0)
    _launch(side, side, paged, ids.numel(), paged.geometry.num_layers, 1, rope, delta, inv_freq)


def split_heads(
    paged: PagedKV,
    block_ids: BlockIds,
    out: torch.Tensor | None = None,
    block_major: bool = False,
) -> torch.Tensor:
    """See `kernels.reference.split_heads`."""
    g = paged.geometry
    ids, out = buffer_for(paged, block_ids, out, per_head=True, block_major=block_major)
    n = ids.numel()
    dst = _head_side(out, paged, n, block_major)
    _launch(_paged_side(paged, ids), dst, paged, n, _lk(paged), g.kv_factor)
    return out


def merge_heads(
    head_buffers: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    block_major: bool = False,
) -> None:
    """See `kernels.reference.merge_heads`."""
    g = paged.geometry
    ids, _ = buffer_for(paged, block_ids, head_buffers, per_head=True, block_major=block_major)
    n = ids.numel()
    src, dst = _head_side(head_buffers, paged, n, block_major), _paged_side(paged, ids)
    _launch(src, dst, paged, n, _lk(paged), g.kv_factor)


def merge_heads_gated(
    units: torch.Tensor,
    paged: PagedKV,
    block_ids: torch.Tensor,
    flags: torch.Tensor,
    group_of: torch.Tensor,
    first_head: int = 0,
) -> None:
    """Block-first units `[n, object_heads, layers, kv, block_size, dim]` (contiguous, the KV
    dtype; `object_heads` >= the cache's heads) -> paged, heads `[first_head, first_head +
    heads)` of each, block `i` written only where `flags[0 .. group_of[i]]` (int32, on the
    device) are all nonzero: one launch, queued with no host wait on the flags. `block_ids` and
    `group_of`: int64 tensors on the device, ids distinct (not range-checked here)."""
    g = paged.geometry
    n, heads = int(units.shape[0]), int(units.shape[1])
    if (
        units.dim() != 6
        or tuple(units.shape[2:]) != (g.num_layers, g.kv_factor, g.block_size, g.head_dim)
        or not units.is_contiguous()
        or units.dtype != g.dtype
        or not 0 <= first_head <= heads - g.num_kv_heads
    ):
        raise LayoutError("gated units do not hold these blocks' heads of this cache")
    if block_ids.numel() != n or group_of.numel() != n or n == 0:
        if n == 0:
            return
        raise LayoutError("one block id and one group index per block")
    unit = g.block_size * g.head_dim
    per_unit = g.num_layers * g.kv_factor * unit
    base = units[:, first_head:]
    src = _Side(
        base=base,
        tab=None,
        lk_stride=unit,
        ids=None,
        bstride=heads * per_unit,
        tstride=g.head_dim,
        hstride=per_unit,
        aligned=base.data_ptr() % _VEC_BYTES == 0,
    )
    dst = _paged_side(paged, block_ids)
    _launch(src, dst, paged, n, _lk(paged), g.kv_factor, gate=(flags, group_of))
