"""The public entry points: each picks the best backend for the tensors it is given (Triton for
CUDA tensors when triton imports, torch-npu for Ascend tensors, the PyTorch reference otherwise)
and forwards the call unchanged. `backend=` forces one."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType
from typing import Literal

import torch

from kernels import reference
from kernels.layouts import BackendUnavailable, BlockIds, PagedKV
from kernels.rope import RopeSpec

Backend = Literal["triton", "npu", "reference"]


@cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def pick_backend(device: torch.device) -> Backend:
    """Best backend for tensors on `device`."""
    if device.type == "cuda" and _triton_importable():
        return "triton"
    if device.type == "npu":
        return "npu"
    return "reference"


def _module(backend: Backend | None, device: torch.device) -> ModuleType:
    """The named backend's module; unnamed, the best one that imports (the reference last)."""
    chosen = backend or pick_backend(device)
    if chosen == "reference":
        return reference
    try:
        return importlib.import_module(f"kernels.{chosen}")
    except ImportError as exc:
        if backend is None:
            return reference
        raise BackendUnavailable(f"backend {chosen!r} cannot be imported: {exc}") from exc


def gather_blocks(
    paged: PagedKV,
    block_ids: BlockIds,
    out: torch.Tensor | None = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Paged -> block-first staging `[n, layers, kv, block_size*heads*dim]` for `block_ids`."""
    result: torch.Tensor = _module(backend, paged.device).gather_blocks(paged, block_ids, out)
    return result


def scatter_blocks(
    staging: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    *,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """Staging -> paged; with `rope`, K re-rotated by `delta` positions on the way."""
    _module(backend, paged.device).scatter_blocks(staging, paged, block_ids, rope, delta, inv_freq)


def copy_blocks(
    src: PagedKV,
    dst: PagedKV,
    src_ids: BlockIds,
    dst_ids: BlockIds,
    *,
    rope: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    inv_freq: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """Paged -> paged block copy, K re-rotated by `delta` when `rope` is given."""
    _module(backend, dst.device).copy_blocks(src, dst, src_ids, dst_ids, rope, delta, inv_freq)


def rerotate_blocks(
    paged: PagedKV,
    block_ids: BlockIds,
    rope: RopeSpec,
    delta: int | torch.Tensor,
    *,
    inv_freq: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """Re-rotate K of the listed blocks in place by `delta` positions."""
    _module(backend, paged.device).rerotate_blocks(paged, block_ids, rope, delta, inv_freq)


def split_heads(
    paged: PagedKV,
    block_ids: BlockIds,
    out: torch.Tensor | None = None,
    *,
    block_major: bool = False,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Paged -> per-head buffers `[heads, n, layers, kv, block_size, dim]`, or block-first
    `[n, heads, layers, kv, block_size, dim]` with `block_major`."""
    result: torch.Tensor = _module(backend, paged.device).split_heads(
        paged, block_ids, out, block_major
    )
    return result


def merge_heads(
    head_buffers: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    *,
    block_major: bool = False,
    backend: Backend | None = None,
) -> None:
    """Per-head buffers -> paged, the inverse of `split_heads` on a rank of any TP size."""
    _module(backend, paged.device).merge_heads(head_buffers, paged, block_ids, block_major)


def merge_heads_gated(
    units: torch.Tensor,
    paged: PagedKV,
    block_ids: BlockIds,
    flags: torch.Tensor,
    group_of: BlockIds,
    first_head: int = 0,
    *,
    backend: Backend | None = None,
) -> None:
    """Block-first units of `object_heads` heads -> paged (heads `[first_head, first_head +
    heads)`), block `i` only where `flags[0 .. group_of[i]]` are all nonzero: a load's verified
    prefix written with no host wait on the flags (Triton; the reference reads them)."""
    _module(backend, paged.device).merge_heads_gated(
        units, paged, block_ids, flags, group_of, first_head
    )
