"""Paged KV layouts of the engines (vLLM, SGLang, TRT-LLM), the block-first staging layout and the
per-head buffer layout, reduced to one description that every kernel backend reads.

Every engine layout is registered once as a `PagedKV`: for each (layer, kv) pair a strided *block
view* of shape `[num_blocks, block_size, kv_heads, head_dim]` into the engine's own memory. The
staging layout is `[n, num_layers, kv_factor, block_size * kv_heads * head_dim]` with each chunk in
token-major order `[block_size, kv_heads, head_dim]`, whatever the engine; `kv_factor` is 2 (K, V)
or 1 (MLA: one latent head, no V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KernelError(Exception):
    """Base of the errors raised by `kernels`."""


class LayoutError(KernelError, ValueError):
    """Tensors do not match the layout or geometry they are given as."""


class BackendUnavailable(KernelError):
    """The requested backend cannot run here (its package is missing)."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one rank's KV cache as the kernels see it."""

    num_layers: int
    kv_factor: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def chunk_elems(self) -> int:
        """Elements of one (block, layer, kv) chunk: `block_size * kv_heads * head_dim`."""
        return self.block_size * self.num_kv_heads * self.head_dim

    def staging_shape(self, n: int) -> tuple[int, int, int, int]:
        """Block-first staging buffer for `n` blocks: `[n, layers, kv_factor, chunk]`."""
        return (n, self.num_layers, self.kv_factor, self.chunk_elems)

    def head_buffer_shape(
        self, n: int, *, block_major: bool = False
    ) -> tuple[int, int, int, int, int, int]:
        """Per-head buffers for `n` blocks: `[kv_heads, n, layers, kv_factor, block_size, dim]`,
        or block-first `[n, kv_heads, layers, kv_factor, block_size, dim]` when `block_major`.

        `buf[j, i]` (block-first: `buf[i, j]`) is the contiguous unit stored under (global head,
        block `i`); block-first, each block's heads are one contiguous run as well."""
        lead = (n, self.num_kv_heads) if block_major else (self.num_kv_heads, n)
        return (*lead, self.num_layers, self.kv_factor, self.block_size, self.head_dim)


class PagedKV:
    """An engine's paged KV cache registered once: one block view per (layer, kv), in the order
    `layer * kv_factor + kv`, all with the same shape and strides."""

    __slots__ = ("_aligned", "_tables", "geometry", "views")

    def __init__(self, views: Sequence[torch.Tensor], num_layers: int, kv_factor: int) -> None:
        if kv_factor not in (1, 2):
            raise LayoutError(f"kv_factor must be 1 (MLA) or 2, got {kv_factor}")
        if len(views) != num_layers * kv_factor or not views:
            raise LayoutError(f"expected {num_layers * kv_factor} block views, got {len(views)}")
        first = views[0]
        if first.dim() != 4:
            raise LayoutError(
                f"block views are 4-D [blocks, block_size, heads, dim], got {first.dim()}-D"
            )
        for v in views:
            if v.shape != first.shape or v.stride() != first.stride():
                raise LayoutError("all block views must share one shape and one set of strides")
            if v.dtype != first.dtype or v.device != first.device:
                raise LayoutError("all block views must share one dtype and one device")
        if first.stride(3) != 1:
            raise LayoutError("head_dim must be the contiguous dimension")
        nb, bs, h, d = first.shape
        self.views: tuple[torch.Tensor, ...] = tuple(views)
        self.geometry = KVGeometry(num_layers, kv_factor, nb, bs, h, d, first.dtype)
        self._tables: dict[tuple[torch.device, int | None], torch.Tensor] = {}
        self._aligned: dict[int, bool] = {}

    @property
    def device(self) -> torch.device:
        return self.views[0].device

    def aligned(self, nbytes: int) -> bool:
        """Whether every block view starts on an `nbytes` boundary (cached)."""
        if nbytes not in self._aligned:
            self._aligned[nbytes] = all(v.data_ptr() % nbytes == 0 for v in self.views)
        return self._aligned[nbytes]

    def offset_table(self, kv: int | None = None) -> torch.Tensor:
        """Element offset of each block view from `views[0]` (of side `kv` only, when given),
        int64 on the views' device, cached: the engine's tensors live as long as the engine."""
        key = (self.device, kv)
        table = self._tables.get(key)
        if table is None:
            esize = self.views[0].element_size()
            base = self.views[0].data_ptr()
            offsets = []
            views = self.views if kv is None else self.views[kv :: self.geometry.kv_factor]
            for v in views:
                delta = v.data_ptr() - base
                if delta % esize:
                    raise LayoutError("block views are not element-aligned with each other")
                offsets.append(delta // esize)
            table = torch.tensor(offsets, dtype=torch.int64, device=self.device)
            self._tables[key] = table
        return table


def vllm_kv(layers: Sequence[torch.Tensor], *, mla: bool = False, kv_dim: int = 0) -> PagedKV:
    """vLLM layer-first cache: per layer `[2, num_blocks, block_size, kv_heads, head_dim]`
    (FlashAttention; `kv_dim=0`) or `[num_blocks, 2, block_size, kv_heads, head_dim]`
    (FlashInfer; `kv_dim=1`), any strides with head_dim contiguous (vLLM's HND stride order
    too); with `mla=True`, per layer `[num_blocks, block_size, latent_dim]` (one latent head,
    no V)."""
    if mla:
        for t in layers:
            if t.dim() != 3:
                raise LayoutError(f"vLLM MLA layer must be 3-D, got {tuple(t.shape)}")
        return PagedKV([t.unsqueeze(2) for t in layers], len(layers), 1)
    if kv_dim not in (0, 1):
        raise LayoutError(f"kv_dim must be 0 or 1, got {kv_dim}")
    for t in layers:
        if t.dim() != 5 or t.shape[kv_dim] != 2:
            want = "[2, blocks, ...]" if kv_dim == 0 else "[blocks, 2, ...]"
            raise LayoutError(
                f"vLLM layer must be {want} of [block_size, heads, dim], got {tuple(t.shape)}"
            )
    return PagedKV([t.select(kv_dim, kv) for t in layers for kv in (0, 1)], len(layers), 2)


def sglang_kv(
    k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, block_size: int
) -> PagedKV:
    """SGLang token pools: per layer separate K and V `[num_slots, kv_heads, head_dim]` where page
    `b` is slots `[b * block_size, (b + 1) * block_size)`; blocked pools
    `[num_blocks, block_size, kv_heads, head_dim]` are accepted as they are. MLA: `v=None` and
    K `[num_slots, 1, latent_dim]`."""
    vs = list(v) if v is not None else []
    if vs and len(vs) != len(k):
        raise LayoutError("SGLang K and V need one tensor per layer each")

    def blocked(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            return t
        if t.dim() != 3 or t.shape[0] % block_size:
            raise LayoutError(f"SGLang pool must be [slots, heads, dim], got {tuple(t.shape)}")
        return t.unflatten(0, (t.shape[0] // block_size, block_size))

    if not vs:
        return PagedKV([blocked(t) for t in k], len(k), 1)
    return PagedKV([blocked(t) for pair in zip(k, vs, strict=True) for t in pair], len(k), 2)


def trtllm_kv(pool: torch.Tensor) -> PagedKV:
    """TRT-LLM block-first pool `[num_blocks, num_layers, kv_factor, kv_heads, block_size,
    head_dim]` (heads before tokens inside a block, as TRT-LLM stores them)."""
    if pool.dim() != 6:
        raise LayoutError(f"TRT-LLM pool must be 6-D, got {tuple(pool.shape)}")
    num_layers, kvf = pool.shape[1], pool.shape[2]
    views = [pool[:, layer, kv].transpose(1, 2) for layer in range(num_layers) for kv in range(kvf)]
    return PagedKV(views, num_layers, kvf)


def rank_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV-head indices held by `tp_rank` of a TP group of `tp_size`; with fewer KV heads
    than ranks each head is replicated on `tp_size // total_kv_heads` consecutive ranks."""
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside TP size {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise LayoutError(f"{total_kv_heads} KV heads do not split over TP={tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise LayoutError(f"TP={tp_size} is not a multiple of {total_kv_heads} KV heads")
    head = tp_rank * total_kv_heads // tp_size
    return range(head, head + 1)


BlockIds = torch.Tensor | Sequence[int]


def as_block_ids(block_ids: BlockIds, device: torch.device, num_blocks: int) -> torch.Tensor:
    """Block ids as a 1-D int64 tensor on `device` (no copy when already so). Ids given as a
    Python sequence are range-checked here; a tensor's are not (that would wait for the device),
    and the Triton kernels do not bounds-check them."""
    if not isinstance(block_ids, torch.Tensor):
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise LayoutError(f"block ids {bad[:4]} outside [0, {num_blocks})")
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    if ids.dim() != 1:
        raise LayoutError("block ids must be 1-D")
    return ids


def check_staging(staging: torch.Tensor, geometry: KVGeometry, n: int) -> None:
    """Raise unless `staging` is a contiguous block-first buffer for `n` blocks of `geometry`."""
    if tuple(staging.shape) != geometry.staging_shape(n) or not staging.is_contiguous():
        raise LayoutError(
            f"staging must be contiguous {geometry.staging_shape(n)}, got {tuple(staging.shape)}"
        )
    if staging.dtype != geometry.dtype:
        raise LayoutError(f"staging dtype {staging.dtype} != KV dtype {geometry.dtype}")


def check_head_buffers(
    buf: torch.Tensor, geometry: KVGeometry, n: int, *, block_major: bool = False
) -> None:
    """Raise unless `buf` is a contiguous per-head buffer for `n` blocks of `geometry`."""
    shape = geometry.head_buffer_shape(n, block_major=block_major)
    if tuple(buf.shape) != shape or not buf.is_contiguous():
        raise LayoutError(f"head buffers must be contiguous {shape}, got {tuple(buf.shape)}")
    if buf.dtype != geometry.dtype:
        raise LayoutError(f"head buffer dtype {buf.dtype} != KV dtype {geometry.dtype}")
