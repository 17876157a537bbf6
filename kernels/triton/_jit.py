"""Triton kernels behind `kernels.triton.ops`: one flat chunk copy and one row copy (with optional
RoPE re-rotation of K). Both move whole (block, layer, kv) chunks between two strided "sides" in one
launch; a side is a base pointer, per-(layer, kv) element offsets (a table, or `lk * lk_stride`),
optional block ids, and block / token / head strides in elements.

Imported only through `kernels.triton.ops`, which imports triton lazily; decorated at import, so
`TRITON_INTERPRET=1` must be set before this module is (re)loaded to run it on the interpreter.
"""

# mypy: disable-error-code="no-untyped-def"
# Triton kernels take untyped pointer / constexpr parameters by design.

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _side_base(tab, lk, lk_stride, ids, i, bstride, HAS_TAB: tl.constexpr, HAS_IDS: tl.constexpr):
    """Element offset of chunk (block i, layer-kv lk) on one side."""
    if HAS_TAB:  # noqa: SIM108 (Triton: static branch on a constexpr)
        off = tl.load(tab + lk).to(tl.int64)
    else:
        off = lk.to(tl.int64) * lk_stride
    if HAS_IDS:  # noqa: SIM108
        blk = tl.load(ids + i).to(tl.int64)
    else:
        blk = i.to(tl.int64)
    return off + blk * bstride


@triton.jit
def copy_flat_kernel(
    src,
    src_tab,
    src_lks,
    src_ids,
    src_bstride,
    dst,
    dst_tab,
    dst_lks,
    dst_ids,
    dst_bstride,
    LK,
    CHUNK,
    SRC_TAB: tl.constexpr,
    SRC_IDS: tl.constexpr,
    DST_TAB: tl.constexpr,
    DST_IDS: tl.constexpr,
    TILE: tl.constexpr,
    EVEN: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Chunks contiguous on both sides: program (i * LK + lk, tile) copies TILE elements."""
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    i = pid // LK
    lk = pid % LK
    s_off = _side_base(src_tab, lk, src_lks, src_ids, i, src_bstride, SRC_TAB, SRC_IDS)
    d_off = _side_base(dst_tab, lk, dst_lks, dst_ids, i, dst_bstride, DST_TAB, DST_IDS)
    if ALIGN > 1:
        s_off = tl.multiple_of(s_off, ALIGN)
        d_off = tl.multiple_of(d_off, ALIGN)
    offs = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
    if EVEN:
        x = tl.load(src + s_off + offs, eviction_policy="evict_first")
        tl.store(dst + d_off + offs, x, eviction_policy="evict_first")
    else:
        mask = offs < CHUNK
        x = tl.load(src + s_off + offs, mask=mask, eviction_policy="evict_first")
        tl.store(dst + d_off + offs, x, mask=mask, eviction_policy="evict_first")


@triton.jit
def copy_rows_kernel(
    src,
    src_tab,
    src_lks,
    src_ids,
    src_bstride,
    src_tstride,
    src_hstride,
    dst,
    dst_tab,
    dst_lks,
    dst_ids,
    dst_bstride,
    dst_tstride,
    dst_hstride,
    H,
    ROWS_TOTAL,
    D,
    gate_flags,
    gate_map,
    SRC_TAB: tl.constexpr,
    SRC_IDS: tl.constexpr,
    DST_TAB: tl.constexpr,
    DST_IDS: tl.constexpr,
    ROWS: tl.constexpr,
    DP: tl.constexpr,
    LPP: tl.constexpr,
    ALIGN: tl.constexpr,
    GATE: tl.constexpr = False,
):
    """Row copy: a row is one (token, head) vector of D elements, contiguous on both sides.
    Program (i, row tile, group) moves ROWS rows of block i for LPP consecutive layer-kv pairs
    (LPP divides the number of pairs). With GATE, block i moves only when the int32 flags
    `gate_flags[0 .. gate_map[i]]` are all nonzero (a load's verified prefix, read on the device:
    the host need not wait for the checks before it queues the copy)."""
    i = tl.program_id(0)
    rt = tl.program_id(1)
    g = tl.program_id(2)
    rows = rt * ROWS + tl.arange(0, ROWS)
    rmask = rows < ROWS_TOTAL
    if GATE:
        last = tl.load(gate_map + i)
        ok = tl.load(gate_flags)
        for j in range(1, last + 1):
            ok = ok & tl.load(gate_flags + j)
        rmask = rmask & ((rows * 0 + ok) != 0)
    t = rows // H
    h = rows % H
    s_row = t.to(tl.int64) * src_tstride + h.to(tl.int64) * src_hstride
    d_row = t.to(tl.int64) * dst_tstride + h.to(tl.int64) * dst_hstride
    if ALIGN > 1:
        s_row = tl.multiple_of(s_row, ALIGN)
        d_row = tl.multiple_of(d_row, ALIGN)
    dc = tl.arange(0, DP)
    m2 = rmask[:, None] & (dc < D)[None, :]
    for j in tl.static_range(LPP):
        lk = g * LPP + j
        s_base = _side_base(src_tab, lk, src_lks, src_ids, i, src_bstride, SRC_TAB, SRC_IDS)
        d_base = _side_base(dst_tab, lk, dst_lks, dst_ids, i, dst_bstride, DST_TAB, DST_IDS)
        if ALIGN > 1:
            s_base = tl.multiple_of(s_base, ALIGN)
            d_base = tl.multiple_of(d_base, ALIGN)
        sp = src + s_base + s_row
        dp = dst + d_base + d_row
        x = tl.load(sp[:, None] + dc[None, :], mask=m2, eviction_policy="evict_first")
        tl.store(dp[:, None] + dc[None, :], x, mask=m2, eviction_policy="evict_first")


@triton.jit
def rope_kernel(
    src,
    src_tab,
    src_lks,
    src_ids,
    src_bstride,
    src_tstride,
    src_hstride,
    dst,
    dst_tab,
    dst_lks,
    dst_ids,
    dst_bstride,
    dst_tstride,
    dst_hstride,
    freq,
    delta,
    delta0,
    BS,
    D,
    SRC_TAB: tl.constexpr,
    SRC_IDS: tl.constexpr,
    DST_TAB: tl.constexpr,
    DST_IDS: tl.constexpr,
    TT: tl.constexpr,
    LPP: tl.constexpr,
    KVF: tl.constexpr,
    COPY_V: tl.constexpr,
    MODE: tl.constexpr,
    DELTA_TAB: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    DP: tl.constexpr,
    H: tl.constexpr,
    STAGES: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """K re-rotation by a position delta, V optionally copied alongside.

    Program (i, token tile, layer group) takes TT tokens of block i, computes their cos/sin once,
    then walks LPP layers x H heads, each a [TT, D] tile (H is constexpr so that the loop bound
    is a Python int under the interpreter). MODE 1 = GPT-J: a 2-byte element pair (2c, 2c + 1)
    is one 32-bit word, loaded as int32 and unpacked (freq zero-padded to DP/2, which leaves
    pairs past the rotary dims unrotated). MODE 2 = NeoX: pairs (c, c + HALF) for c < HALF, then
    REST columns [2*HALF, D) copied. The delta is per token (DELTA_TAB) or the float delta0.
    STAGES pipelines the head loop (1 = in order). Side kv of layer l is layer-kv l*KVF + kv.
    """
    i = tl.program_id(0)
    tt = tl.program_id(1)
    g = tl.program_id(2)
    t = tt * TT + tl.arange(0, TT)
    tmask = t < BS
    s_t = t.to(tl.int64) * src_tstride
    d_t = t.to(tl.int64) * dst_tstride
    if ALIGN > 1:
        s_t = tl.multiple_of(s_t, ALIGN)
        d_t = tl.multiple_of(d_t, ALIGN)
    if DELTA_TAB:
        dlt = tl.load(delta + i * BS + t, mask=tmask, other=0.0)
    else:
        dlt = tl.full([TT], 0.0, tl.float32) + delta0
    if MODE == 1:
        pc = tl.arange(0, DP // 2)
        ang = dlt[:, None] * tl.load(freq + pc)[None, :]
        pm = tmask[:, None] & (pc < DP // 2)[None, :]
    else:
        pc = tl.arange(0, HALF_P2)
        ang = dlt[:, None] * tl.load(freq + pc, mask=pc < HALF, other=0.0)[None, :]
        pm = tmask[:, None] & (pc < HALF)[None, :]
        if REST_P2 > 0:
            rc = 2 * HALF + tl.arange(0, REST_P2)
            rm = tmask[:, None] & (rc < D)[None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    for q in tl.range(0, LPP * H, num_stages=STAGES):
        lk = (g * LPP + q // H) * KVF
        h = q % H
        s_base = _side_base(src_tab, lk, src_lks, src_ids, i, src_bstride, SRC_TAB, SRC_IDS)
        d_base = _side_base(dst_tab, lk, dst_lks, dst_ids, i, dst_bstride, DST_TAB, DST_IDS)
        s_base += h.to(tl.int64) * src_hstride
        d_base += h.to(tl.int64) * dst_hstride
        if ALIGN > 1:
            s_base = tl.multiple_of(s_base, ALIGN)
            d_base = tl.multiple_of(d_base, ALIGN)
        sp = src + s_base + s_t
        dp = dst + d_base + d_t
        if MODE == 1:
            sw = sp.to(tl.pointer_type(tl.int32))[:, None] + pc[None, :]
            dw = dp.to(tl.pointer_type(tl.int32))[:, None] + pc[None, :]
            w = tl.load(sw, mask=pm, eviction_policy="evict_first")
            a = w.to(tl.int16).to(src.dtype.element_ty, bitcast=True).to(tl.float32)
            b = (w >> 16).to(tl.int16).to(src.dtype.element_ty, bitcast=True).to(tl.float32)
            na = (a * cos - b * sin).to(dst.dtype.element_ty).to(tl.int16, bitcast=True)
            nb = (b * cos + a * sin).to(dst.dtype.element_ty).to(tl.int16, bitcast=True)
            nw = (nb.to(tl.int32) << 16) | (na.to(tl.int32) & 0xFFFF)
            tl.store(dw, nw, mask=pm, eviction_policy="evict_first")
        else:
            lo_p = sp[:, None] + pc[None, :]
            lo = tl.load(lo_p, mask=pm, eviction_policy="evict_first").to(tl.float32)
            hi = tl.load(lo_p + HALF, mask=pm, eviction_policy="evict_first").to(tl.float32)
            nlo = (lo * cos - hi * sin).to(dst.dtype.element_ty)
            nhi = (hi * cos + lo * sin).to(dst.dtype.element_ty)
            do_p = dp[:, None] + pc[None, :]
            tl.store(do_p, nlo, mask=pm, eviction_policy="evict_first")
            tl.store(do_p + HALF, nhi, mask=pm, eviction_policy="evict_first")
            if REST_P2 > 0:
                x = tl.load(sp[:, None] + rc[None, :], mask=rm, eviction_policy="evict_first")
                tl.store(dp[:, None] + rc[None, :], x, mask=rm, eviction_policy="evict_first")
    if COPY_V:
        dc = tl.arange(0, DP)
        vm = tmask[:, None] & (dc < D)[None, :]
        for q in tl.range(0, LPP * H, num_stages=STAGES):
            lk = (g * LPP + q // H) * KVF + 1
            h = q % H
            s_base = _side_base(src_tab, lk, src_lks, src_ids, i, src_bstride, SRC_TAB, SRC_IDS)
            d_base = _side_base(dst_tab, lk, dst_lks, dst_ids, i, dst_bstride, DST_TAB, DST_IDS)
            s_base += h.to(tl.int64) * src_hstride
            d_base += h.to(tl.int64) * dst_hstride
            if ALIGN > 1:
                s_base = tl.multiple_of(s_base, ALIGN)
                d_base = tl.multiple_of(d_base, ALIGN)
            x = tl.load(
                (src + s_base + s_t)[:, None] + dc[None, :], mask=vm, eviction_policy="evict_first"
            )
            tl.store(
                (dst + d_base + d_t)[:, None] + dc[None, :],
                x,
                mask=vm,
                eviction_policy="evict_first",
            )
