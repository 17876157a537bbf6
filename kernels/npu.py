"""Ascend NPU backend of the KV data-movement kernels, through torch-npu.

UNTESTED HERE: no Ascend device or torch-npu on the machines this was written on. `torch_npu` is
imported when a function is first called, never at module import. Each op runs the reference's
indexing on the NPU tensors (index_select / index_put, which torch-npu maps to aclnn kernels), so
the meaning is the reference's by construction; one call issues one small kernel per (layer, kv),
not one fused launch. A fused path (e.g. `torch_npu.npu_kv_rmsnorm_rope_cache`, torch-npu's fused
copy + RoPE) is future work and must be checked against `kernels.reference` on a device.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from kernels import reference
from kernels.layouts import BackendUnavailable

P = ParamSpec("P")
R = TypeVar("R")


@functools.cache
def _require_torch_npu() -> None:
    """Import torch_npu once, which registers the `npu` device with torch."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise BackendUnavailable(f"torch_npu cannot be imported: {exc}") from exc


def _on_npu(op: Callable[P, R]) -> Callable[P, R]:
    """The reference op, run once torch_npu is imported (its docstring is the reference's)."""

    @functools.wraps(op)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        _require_torch_npu()
        return op(*args, **kwargs)

    return run


gather_blocks = _on_npu(reference.gather_blocks)
scatter_blocks = _on_npu(reference.scatter_blocks)
copy_blocks = _on_npu(reference.copy_blocks)
rerotate_blocks = _on_npu(reference.rerotate_blocks)
split_heads = _on_npu(reference.split_heads)
merge_heads = _on_npu(reference.merge_heads)
merge_heads_gated = _on_npu(reference.merge_heads_gated)
