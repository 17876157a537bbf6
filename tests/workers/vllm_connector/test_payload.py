"""vLLM CPU-backend KV pages through the kernels' reference path: the layout the attention kernel
reads, per-head payload round trips, and payloads shared by two TP layouts byte for byte."""

from __future__ import annotations

import pytest
import torch

from kernels import LayoutError, rank_kv_heads
from workers.vllm_connector.payload import (
    cpu_attn_paged_kv,
    gather_head_payloads,
    payload_nbytes,
    payload_of,
    scatter_head_payloads,
)

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 32, 4, 8


def cpu_layers(heads: int = HEADS, *, fill: bool = True, seed: int = 0) -> list[torch.Tensor]:
    """Per layer `[blocks, kv_heads, block_size, 2*head_size]`, as vLLM 0.32 allocates it."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(BLOCKS, heads, BS, 2 * DIM, generator=g).to(torch.bfloat16)
        if fill
        else torch.zeros(BLOCKS, heads, BS, 2 * DIM, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]


def test_views_read_k_and_v_where_the_cpu_attention_kernel_does() -> None:
    layers = cpu_layers()
    paged = cpu_attn_paged_kv(layers)
    for layer, t in enumerate(layers):
        # cpu_attn.py: view (blocks, heads, 2*block_size, head_size), chunk(2, dim=2) -> K, V
        k_cache, v_cache = t.view(BLOCKS, HEADS, 2 * BS, DIM).chunk(2, dim=2)
        k_view, v_view = paged.views[2 * layer], paged.views[2 * layer + 1]
        assert k_view.shape == (BLOCKS, BS, HEADS, DIM)
        assert torch.equal(k_view, k_cache.permute(0, 2, 1, 3))
        assert torch.equal(v_view, v_cache.permute(0, 2, 1, 3))
    assert paged.geometry.num_kv_heads == HEADS and paged.geometry.dtype == torch.bfloat16


def test_a_payload_is_one_heads_block_layer_by_layer_k_then_v() -> None:
    layers = cpu_layers()
    paged = cpu_attn_paged_kv(layers)
    buf = gather_head_payloads(paged, [4, 1])
    data = payload_of(buf, 2, 0)  # head 2 of block 4
    assert len(data) == payload_nbytes(paged.geometry) == LAYERS * 2 * BS * DIM * 2
    unit = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(LAYERS, 2, BS, DIM)
    for layer, t in enumerate(layers):
        page = t[4, 2].reshape(2 * BS, DIM)
        assert torch.equal(unit[layer, 0], page[:BS]) and torch.equal(unit[layer, 1], page[BS:])


def test_payloads_round_trip_into_other_blocks_of_another_cache() -> None:
    src = cpu_attn_paged_kv(cpu_layers(seed=1))
    dst_layers = cpu_layers(fill=False)
    dst = cpu_attn_paged_kv(dst_layers)
    buf = gather_head_payloads(src, [0, 3, 5])
    rows = [[payload_of(buf, j, i) for j in range(HEADS)] for i in range(3)]
    scatter_head_payloads(rows, dst, [2, 1, 4])
    for s_id, d_id in zip([0, 3, 5], [2, 1, 4], strict=True):
        for sv, dv in zip(src.views, dst.views, strict=True):
            assert torch.equal(sv[s_id], dv[d_id])
    untouched = [b for b in range(BLOCKS) if b not in (2, 1, 4)]
    assert all(not t[untouched].any() for t in dst_layers)


def test_producer_and_consumer_of_different_tp_sizes_share_payloads_per_head() -> None:
    """TP=1 (all 4 heads) saves, TP=2 ranks (2 heads each) load their own heads' artifacts."""
    full = cpu_layers(seed=2)
    producer = cpu_attn_paged_kv(full)
    saved = gather_head_payloads(producer, [1, 2])
    store = {(h, i): payload_of(saved, h, i) for h in range(HEADS) for i in range(2)}
    for rank in range(2):
        heads = rank_kv_heads(HEADS, 2, rank)
        consumer_layers = cpu_layers(len(heads), fill=False)
        consumer = cpu_attn_paged_kv(consumer_layers)
        rows = [[store[(h, i)] for h in heads] for i in range(2)]
        scatter_head_payloads(rows, consumer, [3, 0])
        mine = gather_head_payloads(consumer, [3, 0])
        for j, h in enumerate(heads):
            for i in range(2):
                assert payload_of(mine, j, i) == store[(h, i)]
        # ... and the consumer's pages equal the producer's slice of those heads.
        for t_full, t_mine in zip(full, consumer_layers, strict=True):
            assert torch.equal(t_mine[3], t_full[1, heads.start : heads.stop])


def test_a_wrong_size_payload_is_refused_and_nothing_is_written() -> None:
    layers = cpu_layers(fill=False)
    paged = cpu_attn_paged_kv(layers)
    good = b"\x01" * payload_nbytes(paged.geometry)
    with pytest.raises(LayoutError):
        scatter_head_payloads([[good] * HEADS, [good] * (HEADS - 1) + [good[:-2]]], paged, [0, 1])
    with pytest.raises(LayoutError):
        scatter_head_payloads([[good] * HEADS], paged, [0, 1])
    assert all(not t.any() for t in layers)


def test_layers_that_are_not_cpu_attention_pages_are_refused() -> None:
    with pytest.raises(LayoutError):
        cpu_attn_paged_kv([torch.zeros(BLOCKS, HEADS, BS, 2 * DIM + 1)])
    with pytest.raises(LayoutError):
        cpu_attn_paged_kv([torch.zeros(BLOCKS, HEADS, 2 * DIM, BS).transpose(2, 3)])
    with pytest.raises(LayoutError):
        cpu_attn_paged_kv([])


def test_mla_layers_are_one_latent_head() -> None:
    layers = [torch.randn(BLOCKS, BS, 24).to(torch.bfloat16) for _ in range(2)]
    paged = cpu_attn_paged_kv(layers, mla=True)
    assert (paged.geometry.num_kv_heads, paged.geometry.kv_factor) == (1, 1)
    buf = gather_head_payloads(paged, [5])
    assert (
        payload_of(buf, 0, 0)
        == torch.stack([t[5] for t in layers]).view(torch.uint8).numpy().tobytes()
    )
