"""Ascend NPU backend of the KV data-movement kernels, through torch-npu.

UNTESTED HERE: no Ascend device or torch-npu on the machines this was written on. `torch_npu` is
imported when a function is first called, never at module import. Each op runs the reference's
indexing on the NPU tensors (index_select / index_put, which torch-npu maps to aclnn kernels), so
the meaning is the reference's by construction; one call issues one small kernel per (layer, kv),
not one fused launch. A fused path (e.g. `torch_npu.npu_kv_rmsnorm_rope_cache` for copy + RoPE, as
seed 002 proposes) is future work and must be checked against `kernels.reference` on a device.
"""

from __future__ import annotations

import importlib
from functools import cache

import torch

from kernels import reference
from kernels.layouts import BackendUnavailable, BlockIds, PagedKV
from kernels.rope import RopeSpec


@cache
def _require_torch_npu() -> None:
    """Import torch_npu once, which registers the `npu` device with torch."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise BackendUnavailable(f"torch_npu cannot be imported: {exc}") from exc


def gather_blocks(
    paged: PagedKV, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """See `kernels.reference.gather_blocks`."""
    _require_torch_npu()
    return reference.gather_blocks(paged, block_ids, out)


def scatter_blocks(
    staging: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """See `kernels.reference.scatter_blocks`."""
    _require_torch_npu()
    reference.scatter_blocks(staging, paged, block_ids, rope, delta, inv_freq)


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
    _require_torch_npu()
    reference.copy_blocks(src, dst, src_ids, dst_ids, rope, delta, inv_freq)


def rerotate_blocks(
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor | None = None,
) -> None:
    """See `kernels.reference.rerotate_blocks`."""
    _require_torch_npu()
    reference.rerotate_blocks(paged, block_ids, rope, delta, inv_freq)


def split_heads(
    paged: PagedKV, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """See `kernels.reference.split_heads`."""
    _require_torch_npu()
    return reference.split_heads(paged, block_ids, out)


def merge_heads(head_buffers: torch.Tensor, paged: PagedKV, block_ids: BlockIds) -> None:
    """See `kernels.reference.merge_heads`."""
    _require_torch_npu()
    reference.merge_heads(head_buffers, paged, block_ids)
