"""The argument checks every backend runs before it moves a byte: block ids resolved on the
cache's device, staging or per-head buffers allocated or checked against the geometry."""

from __future__ import annotations

import torch

from kernels.layouts import (
    BlockIds,
    LayoutError,
    PagedKV,
    as_block_ids,
    check_head_buffers,
    check_staging,
)


def block_ids_on(paged: PagedKV, block_ids: BlockIds) -> torch.Tensor:
    """`block_ids` as a 1-D int64 tensor on `paged`'s device, range-checked against it."""
    return as_block_ids(block_ids, paged.device, paged.geometry.num_blocks)


def buffer_for(
    paged: PagedKV,
    block_ids: BlockIds,
    buf: torch.Tensor | None,
    *,
    per_head: bool,
    block_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, buf): the block ids on the cache's device and the staging buffer (per-head buffers
    when `per_head`, block-first ones when also `block_major`) for them, allocated when `buf` is
    None, else checked to fit."""
    g = paged.geometry
    ids = block_ids_on(paged, block_ids)
    n = ids.numel()
    if buf is None:
        shape = g.head_buffer_shape(n, block_major=block_major) if per_head else g.staging_shape(n)
        buf = torch.empty(shape, dtype=g.dtype, device=paged.device)
    if per_head:
        check_head_buffers(buf, g, n, block_major=block_major)
    else:
        check_staging(buf, g, n)
    return ids, buf


def paired_ids(
    src: PagedKV, dst: PagedKV, src_ids: BlockIds, dst_ids: BlockIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block copy's source and destination ids, each on its cache's device, of one length."""
    sids = block_ids_on(src, src_ids)
    dids = block_ids_on(dst, dst_ids)
    if sids.numel() != dids.numel():
        raise LayoutError("src_ids and dst_ids differ in length")
    return sids, dids


def rerotation_ids(paged: PagedKV, block_ids: BlockIds) -> torch.Tensor:
    """The ids of the blocks whose K is re-rotated in place; only a K/V cache has a K."""
    if paged.geometry.kv_factor != 2:
        raise LayoutError("re-rotation needs a K/V cache (MLA's latent is not handled here)")
    return block_ids_on(paged, block_ids)
