"""vLLM CPU-backend KV pages through the kernels' reference path: the page order of the ISA,
per-head payload round trips, and payloads shared by two TP layouts byte for byte."""

from __future__ import annotations

import pytest
import torch

from kernels import LayoutError, rank_kv_heads
from workers.vllm_connector.payload import (
    CpuAttnKV,
    PageOrder,
    calibrate_page_order,
    payload_of,
    scatter_payloads,
)

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 32, 4, 16


def vec_isa_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, block: int) -> None:
    """What vLLM 0.32's AVX-512 ("vec") cache write was measured to do with one block's tokens
    `[BS, H, D]`: per (block, head) page, K transposed `[D, BS]`, then V `[BS, D]`."""
    pages = cache.view(cache.shape[0], cache.shape[1], 2, -1)
    for h in range(key.shape[1]):
        pages[block, h, 0] = key[:, h].t().reshape(-1)
        pages[block, h, 1] = value[:, h].reshape(-1)


def probe_writer(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    cache = torch.zeros(1, 1, key.shape[0], 2 * key.shape[2], dtype=key.dtype)
    vec_isa_write(key, value, cache, 0)
    return cache


VEC_ORDER = calibrate_page_order(probe_writer, BS, DIM, torch.bfloat16)


def engine_cache(
    heads: int = HEADS, *, seed: int = 0, fill: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Layer caches written the vec way, and the token-major K, V `[L, blocks, BS, H, D]`."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, BLOCKS, BS, heads, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(LAYERS, BLOCKS, BS, heads, DIM, generator=g).to(torch.bfloat16)
    layers = [torch.zeros(BLOCKS, heads, BS, 2 * DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    if fill:
        for layer, t in enumerate(layers):
            for b in range(BLOCKS):
                vec_isa_write(k[layer, b], v[layer, b], t, b)
    return layers, k, v


def test_calibration_finds_the_transposed_k_and_token_major_v() -> None:
    half = BS * DIM
    # token-major element (token 1, dim 0) sits at native position 1 * BS + 0 ... of K: dim-major
    assert VEC_ORDER.k_to_native[1 * DIM + 0].item() == 0 * BS + 1
    assert torch.equal(VEC_ORDER.v_to_native, torch.arange(half))
    assert not VEC_ORDER.is_token_major
    assert PageOrder.token_major(BS, DIM).is_token_major


def test_a_write_that_loses_elements_is_not_a_page_order() -> None:
    def lossy(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cache = probe_writer(key, value)
        cache[0, 0, 0, :2] = 0
        return cache

    with pytest.raises(LayoutError):
        calibrate_page_order(lossy, BS, DIM, torch.bfloat16)
    with pytest.raises(LayoutError):
        calibrate_page_order(probe_writer, 512, DIM, torch.bfloat16)


def test_gather_gives_token_major_k_and_v_per_head_and_block() -> None:
    layers, k, v = engine_cache()
    kv = CpuAttnKV(layers, VEC_ORDER)
    buf = kv.gather([4, 1])
    assert buf.shape == (HEADS, 2, LAYERS, 2, BS, DIM)
    for j, b in enumerate([4, 1]):
        for h in range(HEADS):
            assert torch.equal(buf[h, j, :, 0], k[:, b, :, h])
            assert torch.equal(buf[h, j, :, 1], v[:, b, :, h])
    data = payload_of(buf, 2, 0)
    assert len(data) == kv.payload_nbytes == LAYERS * 2 * BS * DIM * 2
    unit = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(LAYERS, 2, BS, DIM)
    assert torch.equal(unit[:, 0], k[:, 4, :, 2]) and torch.equal(unit[:, 1], v[:, 4, :, 2])


def test_payloads_round_trip_into_other_blocks_of_another_cache() -> None:
    src_layers, _, _ = engine_cache(seed=1)
    src = CpuAttnKV(src_layers, VEC_ORDER)
    dst_layers, _, _ = engine_cache(fill=False)
    dst = CpuAttnKV(dst_layers, VEC_ORDER)
    buf = src.gather([0, 3, 5])
    rows = [[payload_of(buf, j, i) for j in range(HEADS)] for i in range(3)]
    scatter_payloads(rows, dst, [2, 1, 4])
    for s_id, d_id in zip([0, 3, 5], [2, 1, 4], strict=True):
        for st, dt in zip(src_layers, dst_layers, strict=True):
            assert torch.equal(st[s_id], dt[d_id])  # native pages, byte for byte
    untouched = [b for b in range(BLOCKS) if b not in (2, 1, 4)]
    assert all(not t[untouched].any() for t in dst_layers)


def test_an_engine_with_token_major_pages_reads_the_same_payloads() -> None:
    """Portable across ISAs: a token-major engine and the vec engine exchange the same bytes."""
    layers, k, _ = engine_cache(seed=3)
    vec = CpuAttnKV(layers, VEC_ORDER)
    other_layers = [torch.zeros_like(t) for t in layers]
    other = CpuAttnKV(other_layers)  # token-major pages
    buf = vec.gather([2])
    scatter_payloads([[payload_of(buf, j, 0) for j in range(HEADS)]], other, [5])
    page = other_layers[1][5, 3].view(2, BS, DIM)
    assert torch.equal(page[0], k[1, 2, :, 3])
    assert payload_of(other.gather([5]), 3, 0) == payload_of(buf, 3, 0)


def test_producer_and_consumer_of_different_tp_sizes_share_payloads_per_head() -> None:
    """TP=1 (all 4 heads) saves, TP=2 ranks (2 heads each) load their own heads' artifacts."""
    full, k, _ = engine_cache(seed=2)
    producer = CpuAttnKV(full, VEC_ORDER)
    saved = producer.gather([1, 2])
    store = {(h, i): payload_of(saved, h, i) for h in range(HEADS) for i in range(2)}
    for rank in range(2):
        heads = rank_kv_heads(HEADS, 2, rank)
        consumer_layers, _, _ = engine_cache(len(heads), fill=False)
        consumer = CpuAttnKV(consumer_layers, VEC_ORDER)
        scatter_payloads([[store[(h, i)] for h in heads] for i in range(2)], consumer, [3, 0])
        mine = consumer.gather([3, 0])
        for j, h in enumerate(heads):
            for i in range(2):
                assert payload_of(mine, j, i) == store[(h, i)]
            assert torch.equal(mine[j, 0, :, 0], k[:, 1, :, h])
        for t_full, t_mine in zip(full, consumer_layers, strict=True):
            assert torch.equal(t_mine[3], t_full[1, heads.start : heads.stop])


def test_a_wrong_size_payload_is_refused_and_nothing_is_written() -> None:
    layers, _, _ = engine_cache(fill=False)
    kv = CpuAttnKV(layers, VEC_ORDER)
    good = b"\x01" * kv.payload_nbytes
    with pytest.raises(LayoutError):
        scatter_payloads([[good] * HEADS, [good] * (HEADS - 1) + [good[:-2]]], kv, [0, 1])
    with pytest.raises(LayoutError):
        scatter_payloads([[good] * HEADS], kv, [0, 1])
    assert all(not t.any() for t in layers)


def test_layers_that_are_not_cpu_attention_pages_are_refused() -> None:
    with pytest.raises(LayoutError):
        CpuAttnKV([torch.zeros(BLOCKS, HEADS, BS, 2 * DIM + 1)])
    with pytest.raises(LayoutError):
        CpuAttnKV([torch.zeros(BLOCKS, HEADS, 2 * DIM, BS).transpose(2, 3)])
    with pytest.raises(LayoutError):
        CpuAttnKV([])
    with pytest.raises(LayoutError):
        CpuAttnKV([torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)], PageOrder.token_major(BS, 8))
