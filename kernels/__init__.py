"""KV data movement for the worker sidecars: block gather/scatter between engine paged layouts and
a block-first staging buffer, per-head split/merge across TP sizes, and RoPE re-rotation of cached
K. Imports only torch; triton and torch_npu are imported when a tensor on their device asks."""

from kernels.dispatch import (
    Backend,
    copy_blocks,
    gather_blocks,
    merge_heads,
    merge_heads_gated,
    pick_backend,
    rerotate_blocks,
    scatter_blocks,
    split_heads,
)
from kernels.layouts import (
    BackendUnavailable,
    KernelError,
    KVGeometry,
    LayoutError,
    PagedKV,
    rank_kv_heads,
    sglang_kv,
    trtllm_kv,
    vllm_kv,
)
from kernels.rope import RopeSpec, apply_rope

__all__ = [
    "Backend",
    "BackendUnavailable",
    "KVGeometry",
    "KernelError",
    "LayoutError",
    "PagedKV",
    "RopeSpec",
    "apply_rope",
    "copy_blocks",
    "gather_blocks",
    "merge_heads",
    "merge_heads_gated",
    "pick_backend",
    "rank_kv_heads",
    "rerotate_blocks",
    "scatter_blocks",
    "sglang_kv",
    "split_heads",
    "trtllm_kv",
    "vllm_kv",
]
