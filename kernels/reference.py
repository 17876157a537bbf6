"""PyTorch reference of every KV data-movement kernel: plain indexing, one (layer, kv) at a time.

These functions define what the kernels mean; the Triton and NPU paths must match them exactly
(copies) or within bf16 rounding (RoPE). They run on any device, and are the naive baseline that
`bench/kernels/gpu_check.py` times.
"""

from __future__ import annotations

import torch

from kernels.checks import buffer_for, paired_ids, rerotation_ids
from kernels.layouts import BlockIds, LayoutError, PagedKV
from kernels.rope import RopeSpec, rotate, token_deltas


def _maybe_rotate(
    x: torch.Tensor,
    kv: int,
    rope: RopeSpec | None,
    deltas: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
) -> torch.Tensor:
    """`x[n, bs, H, D]`: rotate K (kv 0) by the per-token deltas `[n * bs]`; V passes through."""
    if rope is None or kv != 0 or deltas is None:
        return x
    n, bs = x.shape[0], x.shape[1]
    return rotate(x.reshape(n * bs, *x.shape[2:]), deltas, rope, inv_freq).view_as(x)


def gather_blocks(
    paged: PagedKV, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Paged -> staging: `out[i, l, kv]` = block `block_ids[i]` of layer `l`, side `kv`, flattened
    token-major `[block_size, kv_heads, head_dim]`. Returns `out` (allocated when None)."""
    g = paged.geometry
    ids, out = buffer_for(paged, block_ids, out, per_head=False)
    n = ids.numel()
    o = out.view(n, g.num_layers, g.kv_factor, g.block_size, g.num_kv_heads, g.head_dim)
    for lk, view in enumerate(paged.views):
        layer, kv = divmod(lk, g.kv_factor)
        o[:, layer, kv] = view[ids]
    return out


def scatter_blocks(
    staging: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """Staging -> paged, the inverse of `gather_blocks`; with `rope`, K is re-rotated by `delta`
    (one int or one value per token, in staging order) on the way."""
    g = paged.geometry
    ids, _ = buffer_for(paged, block_ids, staging, per_head=False)
    n = ids.numel()
    deltas = token_deltas(delta, n * g.block_size, paged.device) if rope is not None else None
    s = staging.view(n, g.num_layers, g.kv_factor, g.block_size, g.num_kv_heads, g.head_dim)
    for lk, view in enumerate(paged.views):
        layer, kv = divmod(lk, g.kv_factor)
        view[ids] = _maybe_rotate(s[:, layer, kv], kv, rope, deltas, inv_freq)


def copy_blocks(
    src: PagedKV,
    dst: PagedKV,
    src_ids: BlockIds,
    dst_ids: BlockIds,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """Paged -> paged: block `src_ids[i]` of `src` into block `dst_ids[i]` of `dst` for every layer
    and side, K re-rotated by `delta` when `rope` is given. Layouts may differ; geometry may not."""
    gs, gd = src.geometry, dst.geometry
    if (gs.num_layers, gs.kv_factor, gs.block_size, gs.num_kv_heads, gs.head_dim) != (
        gd.num_layers,
        gd.kv_factor,
        gd.block_size,
        gd.num_kv_heads,
        gd.head_dim,
    ):
        raise LayoutError("copy_blocks needs the same geometry on both sides")
    sids, dids = paired_ids(src, dst, src_ids, dst_ids)
    n = sids.numel()
    deltas = token_deltas(delta, n * gs.block_size, dst.device) if rope is not None else None
    for lk, (sv, dv) in enumerate(zip(src.views, dst.views, strict=True)):
        kv = lk % gs.kv_factor
        dv[dids] = _maybe_rotate(sv[sids], kv, rope, deltas, inv_freq)


def rerotate_blocks(
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """In place: re-rotate K of the listed blocks, all layers, by `delta` (one int or one value
    per token in block-list order); V is untouched."""
    ids = rerotation_ids(paged, block_ids)
    deltas = token_deltas(delta, ids.numel() * paged.geometry.block_size, paged.device)
    for view in paged.views[0::2]:
        view[ids] = _maybe_rotate(view[ids], 0, rope, deltas, inv_freq)


def split_heads(
    paged: PagedKV,
    block_ids: BlockIds,
    out: torch.Tensor | None = None,
    block_major: bool = False,
) -> torch.Tensor:
    """Paged -> per-head buffers: `out[j, i, l, kv]` = head `j` (local index) of block
    `block_ids[i]`, layer `l`, side `kv`, as `[block_size, head_dim]`; block-first
    (`block_major`) the same unit is `out[i, j, l, kv]`. The caller keys the unit of local head
    `j` by the global head `rank_kv_heads(...)[j]`."""
    g = paged.geometry
    ids, out = buffer_for(paged, block_ids, out, per_head=True, block_major=block_major)
    order = (0, 2, 1, 3) if block_major else (2, 0, 1, 3)  # [n, H, bs, D] or [H, n, bs, D]
    for lk, view in enumerate(paged.views):
        layer, kv = divmod(lk, g.kv_factor)
        out[:, :, layer, kv] = view[ids].permute(*order)
    return out


def merge_heads(
    head_buffers: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    block_major: bool = False,
) -> None:
    """Per-head buffers -> paged, the inverse of `split_heads`: `head_buffers[j]` (block-first:
    `head_buffers[:, j]`) holds local head `j` of the destination rank (gathered from whichever
    producer ranks held those heads)."""
    g = paged.geometry
    ids, _ = buffer_for(paged, block_ids, head_buffers, per_head=True, block_major=block_major)
    order = (0, 2, 1, 3) if block_major else (1, 2, 0, 3)  # to [n, bs, H, D]
    for lk, view in enumerate(paged.views):
        layer, kv = divmod(lk, g.kv_factor)
        view[ids] = head_buffers[:, :, layer, kv].permute(*order)


def merge_heads_gated(
    units: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    flags: torch.Tensor,
    group_of: BlockIds,
    first_head: int = 0,
) -> None:
    """Block-first units `[n, object_heads, layers, kv, block_size, dim]` -> paged, heads
    `[first_head, first_head + heads)` of each, block `i` only where `flags[0 .. group_of[i]]`
    are all nonzero (the Triton version reads the flags on the device, with no host wait)."""
    h = paged.geometry.num_kv_heads
    ids = [int(b) for b in torch.as_tensor(block_ids).tolist()]
    groups = [int(x) for x in torch.as_tensor(group_of).tolist()]
    ok = [int(x) != 0 for x in flags.tolist()]
    if len(ids) != int(units.shape[0]) or len(groups) != len(ids):
        raise LayoutError("one block id and one group index per block")
    if not 0 <= first_head <= int(units.shape[1]) - h:
        raise LayoutError(f"heads [{first_head}, {first_head + h}) of {int(units.shape[1])}")
    write = [i for i, grp in enumerate(groups) if all(ok[: grp + 1])]
    if write:
        picked = units[write][:, first_head : first_head + h].contiguous()
        merge_heads(picked, paged, [ids[i] for i in write], block_major=True)
