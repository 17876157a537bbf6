"""Triton backend of the KV data-movement kernels (NVIDIA GPUs; CPU under TRITON_INTERPRET=1).
Importing this package imports triton; `kernels.dispatch` does so only when a CUDA tensor asks."""

from kernels.triton.ops import (
    copy_blocks,
    gather_blocks,
    merge_heads,
    merge_heads_gated,
    rerotate_blocks,
    scatter_blocks,
    split_heads,
)

__all__ = [
    "copy_blocks",
    "gather_blocks",
    "merge_heads",
    "merge_heads_gated",
    "rerotate_blocks",
    "scatter_blocks",
    "split_heads",
]
