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
    freq,
    delta,
    LK,
    H,
    ROWS_TOTAL,
    BS,
    D,
    SRC_TAB: tl.constexpr,
    SRC_IDS: tl.constexpr,
    DST_TAB: tl.constexpr,
    DST_IDS: tl.constexpr,
    ROWS: tl.constexpr,
    DP: tl.constexpr,
    LPP: tl.constexpr,
    KVF: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Row copy: a row is one (token, head) vector of D elements, contiguous on both sides.

    Program (i, row tile, layer-kv group) moves ROWS rows of block i for LPP consecutive layer-kv
    pairs (LPP divides LK). ROPE: 0 = plain copy; 1 = GPT-J (interleaved pairs, D == DP, freq
    padded with zeros to DP/2); 2 = NeoX (pairs (c, c + HALF) for c < HALF, then D - 2*HALF
    pass-through columns). K (lk % KVF == 0) is rotated by the token's delta; V is copied. LPP
    is a multiple of KVF so the K/V choice is static. A tile's cos/sin are computed once and
    reused for its LPP pairs.
    """
    i = tl.program_id(0)
    rt = tl.program_id(1)
    g = tl.program_id(2)
    rows = rt * ROWS + tl.arange(0, ROWS)
    rmask = rows < ROWS_TOTAL
    t = rows // H
    h = rows % H
    s_row = t.to(tl.int64) * src_tstride + h.to(tl.int64) * src_hstride
    d_row = t.to(tl.int64) * dst_tstride + h.to(tl.int64) * dst_hstride
    if ALIGN > 1:
        s_row = tl.multiple_of(s_row, ALIGN)
        d_row = tl.multiple_of(d_row, ALIGN)
    if ROPE == 1:
        cols = tl.arange(0, DP // 2)
        dlt = tl.load(delta + i * BS + t, mask=rmask, other=0.0)
        ang = dlt[:, None] * tl.load(freq + cols)[None, :]
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    if ROPE == 2:
        hc = tl.arange(0, HALF_P2)
        hmask = hc < HALF
        dlt = tl.load(delta + i * BS + t, mask=rmask, other=0.0)
        ang = dlt[:, None] * tl.load(freq + hc, mask=hmask, other=0.0)[None, :]
        cos = tl.cos(ang)
        sin = tl.sin(ang)
        hm2 = rmask[:, None] & hmask[None, :]
        if REST_P2 > 0:
            rc = 2 * HALF + tl.arange(0, REST_P2)
            rm2 = rmask[:, None] & (rc < D)[None, :]
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
        if ROPE == 0:  # noqa: SIM114 (each branch is static; `or` of constexprs is avoided)
            mm = m2
            x = tl.load(sp[:, None] + dc[None, :], mask=mm, eviction_policy="evict_first")
            tl.store(dp[:, None] + dc[None, :], x, mask=mm, eviction_policy="evict_first")
        elif j % KVF != 0:
            mm = m2
            x = tl.load(sp[:, None] + dc[None, :], mask=mm, eviction_policy="evict_first")
            tl.store(dp[:, None] + dc[None, :], x, mask=mm, eviction_policy="evict_first")
        elif ROPE == 1:
            mm = m2
            x = tl.load(sp[:, None] + dc[None, :], mask=mm, eviction_policy="evict_first")
            a, b = tl.split(tl.reshape(x.to(tl.float32), (ROWS, DP // 2, 2)))
            ra = a * cos - b * sin
            rb = b * cos + a * sin
            y = tl.reshape(tl.join(ra, rb), (ROWS, DP)).to(x.dtype)
            tl.store(dp[:, None] + dc[None, :], y, mask=mm, eviction_policy="evict_first")
        else:
            mm = hm2
            lo = tl.load(sp[:, None] + hc[None, :], mask=mm, eviction_policy="evict_first")
            hi = tl.load(sp[:, None] + (hc + HALF)[None, :], mask=mm, eviction_policy="evict_first")
            lof = lo.to(tl.float32)
            hif = hi.to(tl.float32)
            nlo = (lof * cos - hif * sin).to(lo.dtype)
            nhi = (hif * cos + lof * sin).to(lo.dtype)
            tl.store(dp[:, None] + hc[None, :], nlo, mask=mm, eviction_policy="evict_first")
            tl.store(
                dp[:, None] + (hc + HALF)[None, :], nhi, mask=mm, eviction_policy="evict_first"
            )
            if REST_P2 > 0:
                rmm = rm2
                x = tl.load(sp[:, None] + rc[None, :], mask=rmm, eviction_policy="evict_first")
                tl.store(dp[:, None] + rc[None, :], x, mask=rmm, eviction_policy="evict_first")
