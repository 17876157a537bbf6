"""Per-head artifact keys through the store: KV written by one TP layout is read by
another TP layout byte-identically per head. Two TP layouts of one model are simulated with the
reference kernels (vLLM CPU cannot run TP>1 here): each rank's paged cache holds its own heads."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.layouts import PagedKV, rank_kv_heads, vllm_kv
from ownerserve.kvstate import HeadArtifactKey, store_heads_for_rank
from workers.sidecar.store import ArtifactStore

MODEL = "tiny"
LAYERS, BLOCKS, BS, HEADS, DIM = 2, 6, 4, 4, 8


def rank_cache(tp: int, rank: int, *, mla: bool = False) -> PagedKV:
    if mla:
        return vllm_kv([torch.zeros(BLOCKS, BS, DIM) for _ in range(LAYERS)], mla=True)
    h = len(rank_kv_heads(HEADS, tp, rank))
    return vllm_kv([torch.zeros(2, BLOCKS, BS, h, DIM) for _ in range(LAYERS)])


def save(
    store: ArtifactStore,
    paged: PagedKV,
    heads: range,
    blocks: list[int],
    hashes: list[int],
    write: tuple[int, ...],
) -> None:
    buf = reference.split_heads(paged, blocks)
    for j, head in enumerate(heads):
        if head not in write:
            continue
        for i, h in enumerate(hashes):
            store.put(HeadArtifactKey(MODEL, head, h).to_string(), buf[j, i].numpy().tobytes())


def load(
    store: ArtifactStore, paged: PagedKV, heads: range, blocks: list[int], hashes: list[int]
) -> None:
    g = paged.geometry
    buf = torch.empty(g.head_buffer_shape(len(blocks)), dtype=g.dtype)
    for j, head in enumerate(heads):
        for i, h in enumerate(hashes):
            raw = store.get(HeadArtifactKey(MODEL, head, h).to_string())
            buf[j, i] = torch.frombuffer(bytearray(raw), dtype=g.dtype).view(buf[j, i].shape)
    reference.merge_heads(buf, paged, blocks)


def head_bytes(caches: list[PagedKV], tp: int, blocks: list[int]) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for rank, paged in enumerate(caches):
        buf = reference.split_heads(paged, blocks)
        for j, head in enumerate(rank_kv_heads(HEADS, tp, rank)):
            out.setdefault(head, buf[j].numpy().tobytes())
    return out


@pytest.mark.parametrize(("tp_prod", "tp_cons"), [(1, 2), (2, 4), (4, 1), (8, 2)])
def test_other_tp_layout_loads_identical_heads(tp_prod: int, tp_cons: int) -> None:
    torch.manual_seed(0)
    store = ArtifactStore(memory_capacity_bytes=1 << 24, pin_memory=False)
    hashes = [0x1111, 0x2222, 0x3333]
    prod_blocks, cons_blocks = [5, 0, 3], [1, 4, 2]  # different physical blocks
    producers = [rank_cache(tp_prod, r) for r in range(tp_prod)]
    # fill with random KV, replicated heads identical across their replicas (as in vLLM)
    full = [torch.randn(2, BLOCKS, BS, HEADS, DIM) for _ in range(LAYERS)]
    for r, paged in enumerate(producers):
        heads = rank_kv_heads(HEADS, tp_prod, r)
        for layer, view in zip(range(LAYERS), paged.views[0::2], strict=True):
            view.copy_(full[layer][0][:, :, heads.start : heads.stop])
        for layer, view in zip(range(LAYERS), paged.views[1::2], strict=True):
            view.copy_(full[layer][1][:, :, heads.start : heads.stop])
        save(store, paged, heads, prod_blocks, hashes, store_heads_for_rank(HEADS, tp_prod, r))
    # every head is stored exactly once, whatever the TP size that wrote it
    assert len(store.keys()) == HEADS * len(hashes)
    consumers = [rank_cache(tp_cons, r) for r in range(tp_cons)]
    for r, paged in enumerate(consumers):
        load(store, paged, rank_kv_heads(HEADS, tp_cons, r), cons_blocks, hashes)
    want = head_bytes(producers, tp_prod, prod_blocks)
    got = head_bytes(consumers, tp_cons, cons_blocks)
    assert sorted(got) == list(range(HEADS))
    for head in range(HEADS):
        assert got[head] == want[head], f"head {head} differs"
    # a consumer rank's blocks it did not load stay untouched
    untouched = [b for b in range(BLOCKS) if b not in cons_blocks]
    for paged in consumers:
        assert all(float(v[untouched].abs().sum()) == 0.0 for v in paged.views)


def test_mla_is_one_head_for_every_rank() -> None:
    store = ArtifactStore(memory_capacity_bytes=1 << 20, pin_memory=False)
    prod = rank_cache(1, 0, mla=True)
    for v in prod.views:
        v.copy_(torch.randn_like(v))
    save(store, prod, range(1), [0, 1], [7, 8], (0,))
    assert len(store.keys()) == 2
    for _rank in range(4):  # every TP rank of an MLA model loads head 0
        cons = rank_cache(4, 0, mla=True)
        load(store, cons, range(1), [3, 2], [7, 8])
        assert (
            reference.split_heads(cons, [3, 2]).numpy().tobytes()
            == reference.split_heads(prod, [0, 1]).numpy().tobytes()
        )
