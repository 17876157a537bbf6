"""vLLM's paged KV cache seen through `kernels`, and one block's per-head artifact payload.

vLLM 0.32 hands a connector one tensor per attention layer, logically `[num_blocks, num_kv_heads,
block_size, C]` (layout LBHNC, the only one the CPU backend takes) with `C = 2 * head_size`. The CPU
attention kernel (`CPU_ATTN`) reinterprets each (block, head) page as `[2 * block_size, head_size]`:
the K of the block's tokens, then their V. Physically a layer is therefore
`[num_blocks, num_kv_heads, 2 (K, V), block_size, head_size]` — heads before tokens inside a block,
as TRT-LLM stores them — and `cpu_attn_paged_kv` registers exactly that as a `kernels.PagedKV`
(strided views, no copy). MLA layers (`[num_blocks, block_size, latent]`, or with a head axis of
one) are one latent head.

Payload of the artifact (head `h`, block `b`): that head's slice of the block in the block-first
staging layout of `kernels.layouts`, `[num_layers, kv_factor, block_size, head_size]` contiguous,
raw little-endian elements of the cache dtype (`KVGeometry.head_buffer_shape(n)[j, i]`), so the
bytes do not depend on the TP size that wrote them. The size is checked on unpack; integrity is
the sidecar's SHA-256 checksum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import KVGeometry, LayoutError, PagedKV, merge_heads, split_heads, vllm_kv


def cpu_attn_paged_kv(layers: Sequence[torch.Tensor], *, mla: bool = False) -> PagedKV:
    """Register vLLM CPU-backend layer caches (in model layer order) with the kernels."""
    if not layers:
        raise LayoutError("no KV cache layers")
    if mla:
        return vllm_kv([t.reshape(t.shape[0], t.shape[-2], t.shape[-1]) for t in layers], mla=True)
    views: list[torch.Tensor] = []
    for t in layers:
        if t.dim() != 4 or t.shape[-1] % 2:
            raise LayoutError(
                f"expected [blocks, kv_heads, block_size, 2*head_size], got {tuple(t.shape)}"
            )
        nb, heads, bs, c = t.shape
        d = c // 2
        s_b, s_h, s_n, s_c = t.stride()
        # The kernel's [2*block_size, head_size] reading of a page needs the page contiguous.
        if s_c != 1 or s_n != c:
            raise LayoutError(f"a (block, head) page is not contiguous: strides {t.stride()}")
        pages = t.as_strided((nb, heads, 2, bs, d), (s_b, s_h, bs * d, d, 1))
        for kv in (0, 1):
            views.append(pages[:, :, kv].permute(0, 2, 1, 3))  # [blocks, block_size, heads, dim]
    return PagedKV(views, len(layers), 2)


def payload_nbytes(geometry: KVGeometry) -> int:
    """Bytes of one (head, block) artifact."""
    g = geometry
    itemsize = torch.empty((), dtype=g.dtype).element_size()
    return g.num_layers * g.kv_factor * g.block_size * g.head_dim * itemsize


def gather_head_payloads(paged: PagedKV, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy the blocks out of the engine's cache (staging gather): per-head buffers
    `[local_heads, n, layers, kv, block_size, head_size]`, contiguous, owned by the caller."""
    return split_heads(paged, list(block_ids))


def payload_of(head_buffers: torch.Tensor, local_head: int, index: int) -> bytes:
    """The artifact bytes of local head `local_head`, block `index` of `head_buffers`."""
    unit = head_buffers[local_head, index].contiguous()
    return unit.view(torch.uint8).numpy().tobytes()


def scatter_head_payloads(
    payloads: Sequence[Sequence[bytes]], paged: PagedKV, block_ids: Sequence[int]
) -> None:
    """Write blocks into the engine's cache (staging scatter): `payloads[i][j]` is the artifact of
    block `block_ids[i]` for local head `j`. Raises `LayoutError` (writing nothing) if any payload
    has the wrong size."""
    g = paged.geometry
    n = len(block_ids)
    if len(payloads) != n:
        raise LayoutError(f"{len(payloads)} payload rows for {n} blocks")
    expected = payload_nbytes(g)
    buf = torch.empty(g.head_buffer_shape(n), dtype=g.dtype)
    flat = buf.view(g.num_kv_heads, n, -1).view(torch.uint8)
    for i, row in enumerate(payloads):
        if len(row) != g.num_kv_heads:
            raise LayoutError(f"block {i}: {len(row)} head payloads for {g.num_kv_heads} heads")
        for j, data in enumerate(row):
            if len(data) != expected:
                raise LayoutError(f"payload of {len(data)} bytes, expected {expected}")
            flat[j, i] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    merge_heads(buf.to(paged.device), paged, list(block_ids))
