"""vLLM's CPU KV cache seen through `kernels`, and one block's per-head artifact payload.

**vLLM 0.32 CPU backend (`CPU_ATTN`) KV layout.** The connector gets one tensor per attention
layer, logically `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (layout LBHNC, the only
one the backend takes). The attention kernel reads each (block, head) *page* of
`2 * block_size * head_size` elements as K then V (`view(..., 2 * block_size, head_size)
.chunk(2)`), and the element order inside each half is the ISA's: on AVX-512 ("vec") V is
token-major `[block_size, head_size]` but K is stored transposed, `[head_size, block_size]`
(measured against K and V recomputed from the weights); AMX and other ISAs pack differently.
Physically a layer is `[num_blocks, num_kv_heads, 2 (K, V), page half in the ISA's order]`.

`CpuAttnKV` registers the layers with the kernels as raw pages (one `PagedKV` "head" unit per
(block, head), no copy) so gather/scatter run on the kernels' reference path, and converts between
the ISA's order and token-major with a `PageOrder` that `calibrate_page_order` measures once by
writing probe tokens through the engine's own cache-write op.

**Payload** of the artifact (head `h`, block `b`): that head's slice of the block in the block-first
staging layout of `kernels.layouts`, `[num_layers, 2 (K, V), block_size, head_size]` token-major,
contiguous, raw little-endian elements of the cache dtype — the same bytes whatever TP size or CPU
ISA wrote them. The size is checked on unpack; integrity is the sidecar's XXH3-128 checksum.

`WorkerKV` is what the connector's worker side uses of a cache: `CpuAttnKV` here, `CudaPagedKV`
(`gpu.py`, vLLM's CUDA layouts) there; `payload_of` and `scatter_payloads` serve both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import LayoutError, PagedKV, merge_heads, split_heads

# Probe values must be exact in the cache dtype: bf16 holds integers up to 256 exactly.
_MAX_PROBE = 256

# One artifact's bytes: a copy (CPU path, sidecar GETs) or a view into pinned staging (CUDA saves).
Payload = bytes | memoryview


class StagedBlocks(Protocol):
    """A save's blocks copied out of the cache, on their way to (or in) host memory."""

    def payload(self, local_head: int, index: int) -> Payload:
        """The artifact of local head `local_head`, block `index` (waits for the copy)."""
        ...


# What `WorkerKV.gather` returns: CPU per-head buffers, or staged blocks of a device cache.
Gathered = torch.Tensor | StagedBlocks


class WorkerKV(Protocol):
    """One rank's KV cache as the connector's worker side uses it."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def payload_nbytes(self) -> int:
        """Bytes of one (head, block) artifact."""
        ...

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        """Copy blocks out (at the end of a step; the engine may reuse them right after)."""
        ...

    def scatter_payloads(
        self, payloads: Sequence[Sequence[Payload]], block_ids: Sequence[int]
    ) -> None:
        """Write `payloads[i][j]` (block `block_ids[i]`, local head `j`) into the cache; raises
        `LayoutError`, writing nothing, if any payload has the wrong size."""
        ...


@dataclass(frozen=True, slots=True)
class PageOrder:
    """Where each element of a page half sits: `k_to_native[j]` is the native position of the
    token-major K element `j = token * head_size + dim` (likewise V); `*_from_native` invert."""

    k_to_native: torch.Tensor
    v_to_native: torch.Tensor
    k_from_native: torch.Tensor
    v_from_native: torch.Tensor

    @classmethod
    def from_native(cls, k_to_native: torch.Tensor, v_to_native: torch.Tensor) -> PageOrder:
        def inverse(p: torch.Tensor) -> torch.Tensor:
            n = p.numel()
            if sorted(p.tolist()) != list(range(n)):
                raise LayoutError("a page order must be a permutation")
            inv = torch.empty_like(p)
            inv[p] = torch.arange(n, dtype=p.dtype)
            return inv

        k = k_to_native.to(torch.int64)
        v = v_to_native.to(torch.int64)
        return cls(k, v, inverse(k), inverse(v))

    @classmethod
    def token_major(cls, block_size: int, head_size: int) -> PageOrder:
        ident = torch.arange(block_size * head_size)
        return cls.from_native(ident, ident)

    @property
    def is_token_major(self) -> bool:
        ident = torch.arange(self.k_to_native.numel())
        return bool(torch.equal(self.k_to_native, ident) and torch.equal(self.v_to_native, ident))


# Writes K and V `[block_size, 1, head_size]` of one block into a zeroed one-block, one-head cache
# `[1, 1, block_size, 2 * head_size]` the way the engine does, and returns that cache.
PageWriter = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def calibrate_page_order(
    write: PageWriter, block_size: int, head_size: int, dtype: torch.dtype
) -> PageOrder:
    """Measure the engine's in-page element order: write tokens whose every element is its token
    index (then its dim index) and see where each lands."""
    if block_size > _MAX_PROBE or head_size > _MAX_PROBE:
        raise LayoutError(f"page order probing needs block_size and head_size <= {_MAX_PROBE}")
    half = block_size * head_size
    tok = torch.arange(block_size, dtype=torch.float32)[:, None].expand(block_size, head_size)
    dim = torch.arange(head_size, dtype=torch.float32)[None, :].expand(block_size, head_size)

    def probe(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = values.reshape(block_size, 1, head_size).to(dtype).contiguous()
        page = write(x, (x + 0).contiguous()).reshape(-1).float()
        if page.numel() != 2 * half:
            raise LayoutError(f"probe page holds {page.numel()} elements, expected {2 * half}")
        return page[:half].round().long(), page[half:].round().long()

    k_tok, v_tok = probe(tok)
    k_dim, v_dim = probe(dim)
    k_to_native = torch.empty(half, dtype=torch.int64)
    v_to_native = torch.empty(half, dtype=torch.int64)
    # native position i holds token-major element tok * head_size + dim
    k_to_native[k_tok * head_size + k_dim] = torch.arange(half)
    v_to_native[v_tok * head_size + v_dim] = torch.arange(half)
    if sorted((k_tok * head_size + k_dim).tolist()) != list(range(half)) or sorted(
        (v_tok * head_size + v_dim).tolist()
    ) != list(range(half)):
        raise LayoutError("the engine's cache write is not a permutation of the page")
    return PageOrder.from_native(k_to_native, v_to_native)


def _permute_kv(halves: torch.Tensor, k_index: torch.Tensor, v_index: torch.Tensor) -> torch.Tensor:
    """Reorder the elements of each page half (`[..., 2, half]`, K then V) by the given
    indices: between the cache's native order and token-major (`PageOrder`)."""
    return torch.stack(
        (halves[..., 0, :].index_select(-1, k_index), halves[..., 1, :].index_select(-1, v_index)),
        dim=-2,
    )


class CpuAttnKV:
    """vLLM CPU-backend layer caches (model layer order) registered with the kernels."""

    __slots__ = ("block_size", "head_size", "num_kv_heads", "num_layers", "order", "pages")

    def __init__(self, layers: Sequence[torch.Tensor], order: PageOrder | None = None) -> None:
        if not layers:
            raise LayoutError("no KV cache layers")
        views: list[torch.Tensor] = []
        for t in layers:
            if t.dim() != 4 or t.shape[-1] % 2 or t.shape != layers[0].shape:
                raise LayoutError(
                    f"expected [blocks, kv_heads, block_size, 2*head_size], got {tuple(t.shape)}"
                )
            nb, heads, bs, c = t.shape
            s_b, s_h, s_n, s_c = t.stride()
            # The kernel's [2*block_size, head_size] reading of a page needs it contiguous.
            if s_c != 1 or s_n != c:
                raise LayoutError(f"a (block, head) page is not contiguous: strides {t.stride()}")
            # One page per (block, head) as a single "token" of 2*bs*D elements.
            views.append(t.as_strided((nb, 1, heads, bs * c), (s_b, bs * c, s_h, 1)))
        self.pages = PagedKV(views, len(layers), 1)
        self.num_layers = len(layers)
        self.num_kv_heads = layers[0].shape[1]
        self.block_size = layers[0].shape[2]
        self.head_size = layers[0].shape[3] // 2
        self.order = order or PageOrder.token_major(self.block_size, self.head_size)
        if self.order.k_to_native.numel() != self.block_size * self.head_size:
            raise LayoutError("page order does not match the page size")

    @property
    def dtype(self) -> torch.dtype:
        return self.pages.geometry.dtype

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one (head, block) artifact."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.head_size * itemsize

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy blocks out of the cache (staging gather): token-major per-head buffers
        `[local_heads, n, layers, 2, block_size, head_size]`, owned by the caller."""
        raw = split_heads(self.pages, list(block_ids))  # [H, n, L, 1, 1, 2*bs*D]
        h, n, half = self.num_kv_heads, len(block_ids), self.block_size * self.head_size
        halves = raw.view(h, n, self.num_layers, 2, half)
        if not self.order.is_token_major:
            halves = _permute_kv(halves, self.order.k_to_native, self.order.v_to_native)
        return halves.reshape(h, n, self.num_layers, 2, self.block_size, self.head_size)

    def scatter(self, buffers: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write token-major per-head buffers (as `gather` returns) into the cache's blocks."""
        h, n, half = self.num_kv_heads, len(block_ids), self.block_size * self.head_size
        expected = (h, n, self.num_layers, 2, self.block_size, self.head_size)
        if tuple(buffers.shape) != expected or buffers.dtype != self.dtype:
            raise LayoutError(f"buffers must be {expected} of {self.dtype}")
        halves = buffers.reshape(h, n, self.num_layers, 2, half)
        if not self.order.is_token_major:
            halves = _permute_kv(halves, self.order.k_from_native, self.order.v_from_native)
        raw = halves.reshape(h, n, self.num_layers, 1, 1, 2 * half).contiguous()
        merge_heads(raw.to(self.pages.device), self.pages, list(block_ids))

    def scatter_payloads(
        self, payloads: Sequence[Sequence[Payload]], block_ids: Sequence[int]
    ) -> None:
        """See `scatter_payloads`."""
        n = len(block_ids)
        if len(payloads) != n:
            raise LayoutError(f"{len(payloads)} payload rows for {n} blocks")
        expected = self.payload_nbytes
        h = self.num_kv_heads
        buf = torch.empty(
            (h, n, self.num_layers, 2, self.block_size, self.head_size), dtype=self.dtype
        )
        flat = buf.view(h, n, -1).view(torch.uint8)
        for i, row in enumerate(payloads):
            if len(row) != h:
                raise LayoutError(f"block {i}: {len(row)} head payloads for {h} heads")
            for j, data in enumerate(row):
                if len(data) != expected:
                    raise LayoutError(f"payload of {len(data)} bytes, expected {expected}")
                flat[j, i] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.scatter(buf, block_ids)


def payload_of(buffers: Gathered, local_head: int, index: int) -> Payload:
    """The artifact bytes of local head `local_head`, block `index` of what `gather` returned."""
    if not isinstance(buffers, torch.Tensor):
        return buffers.payload(local_head, index)
    unit = buffers[local_head, index].contiguous()
    return unit.view(torch.uint8).numpy().tobytes()


def scatter_payloads(
    payloads: Sequence[Sequence[Payload]], kv: WorkerKV, block_ids: Sequence[int]
) -> None:
    """Write blocks into the cache (staging scatter): `payloads[i][j]` is the artifact of block
    `block_ids[i]` for local head `j`. Raises `LayoutError`, writing nothing, if any payload has
    the wrong size."""
    kv.scatter_payloads(payloads, block_ids)
