"""CPU tests of the PyTorch reference kernels: round trips for every layout, head split/merge
across TP sizes, and RoPE re-rotation identities."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.layouts import LayoutError, PagedKV

L, NB, BS, H, D = 3, 12, 4, 2, 16
IDS = [9, 0, 5, 7]


def _rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def make_layout(name: str) -> tuple[PagedKV, list[torch.Tensor]]:
    """A random cache in `name`'s layout and the engine tensors behind it."""
    if name == "vllm":
        t = [_rand(2, NB, BS, H, D) for _ in range(L)]
        return kernels.vllm_kv(t), t
    if name == "vllm-mla":
        t = [_rand(NB, BS, 3 * D) for _ in range(L)]
        return kernels.vllm_kv(t, mla=True), t
    if name == "sglang":
        k = [_rand(NB * BS, H, D) for _ in range(L)]
        v = [_rand(NB * BS, H, D) for _ in range(L)]
        return kernels.sglang_kv(k, v, BS), k + v
    if name == "sglang-mla":
        k = [_rand(NB * BS, 1, 3 * D) for _ in range(L)]
        return kernels.sglang_kv(k, None, BS), k
    if name == "trtllm":
        pool = _rand(NB, L, 2, H, BS, D)
        return kernels.trtllm_kv(pool), [pool]
    raise AssertionError(name)


LAYOUTS = ["vllm", "vllm-mla", "sglang", "sglang-mla", "trtllm"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_gather_puts_each_block_first_and_token_major(name: str) -> None:
    paged, _ = make_layout(name)
    g = paged.geometry
    out = ref.gather_blocks(paged, IDS)
    assert out.shape == g.staging_shape(len(IDS))
    for i, b in enumerate(IDS):
        for lk, view in enumerate(paged.views):
            layer, kv = divmod(lk, g.kv_factor)
            assert torch.equal(out[i, layer, kv], view[b].reshape(-1))


def test_trtllm_view_matches_pool_heads_before_tokens() -> None:
    pool = _rand(NB, L, 2, H, BS, D)
    out = ref.gather_blocks(kernels.trtllm_kv(pool), [3])
    chunk = out[0, 1, 1].view(BS, H, D)
    assert torch.equal(chunk, pool[3, 1, 1].transpose(0, 1))


@pytest.mark.parametrize("name", LAYOUTS)
def test_scatter_after_gather_is_identity_on_touched_blocks(name: str) -> None:
    paged, tensors = make_layout(name)
    before = [t.clone() for t in tensors]
    staging = ref.gather_blocks(paged, IDS)
    for v in paged.views:
        v[torch.tensor(IDS)] = float("nan")
    ref.scatter_blocks(staging, paged, IDS)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("name", LAYOUTS)
def test_gather_after_scatter_returns_the_staging_and_leaves_other_blocks(name: str) -> None:
    paged, tensors = make_layout(name)
    before = [t.clone() for t in tensors]
    staging = _rand(*paged.geometry.staging_shape(len(IDS)))
    ref.scatter_blocks(staging, paged, IDS)
    assert torch.equal(ref.gather_blocks(paged, IDS), staging)
    untouched = [b for b in range(NB) if b not in IDS]
    after = kernels.gather_blocks(paged, untouched)
    restored = ref.gather_blocks(rebuild(name, before), untouched)
    assert torch.equal(after, restored)


def rebuild(name: str, tensors: list[torch.Tensor]) -> PagedKV:
    if name == "vllm":
        return kernels.vllm_kv(tensors)
    if name == "vllm-mla":
        return kernels.vllm_kv(tensors, mla=True)
    if name == "sglang":
        return kernels.sglang_kv(tensors[:L], tensors[L:], BS)
    if name == "sglang-mla":
        return kernels.sglang_kv(tensors, None, BS)
    return kernels.trtllm_kv(tensors[0])


def test_staging_is_engine_neutral_between_vllm_and_trtllm() -> None:
    vllm, _ = make_layout("vllm")
    trt, _ = make_layout("trtllm")
    staging = ref.gather_blocks(vllm, IDS)
    ref.scatter_blocks(staging, trt, [1, 2, 3, 4])
    assert torch.equal(ref.gather_blocks(trt, [1, 2, 3, 4]), staging)


def test_copy_blocks_between_layouts() -> None:
    src, _ = make_layout("sglang")
    dst, _ = make_layout("vllm")
    ref.copy_blocks(src, dst, IDS, [0, 1, 2, 3])
    assert torch.equal(ref.gather_blocks(dst, [0, 1, 2, 3]), ref.gather_blocks(src, IDS))


@pytest.mark.parametrize(("total", "producer_tp"), [(8, 4), (8, 1), (2, 4)])
def test_split_then_merge_across_tp_sizes_is_identity(total: int, producer_tp: int) -> None:
    full = [_rand(2, NB, BS, total, D) for _ in range(L)]
    per_head: dict[int, torch.Tensor] = {}
    for rank in range(producer_tp):
        heads = kernels.rank_kv_heads(total, producer_tp, rank)
        rank_kv = kernels.vllm_kv([t[:, :, :, heads.start : heads.stop].clone() for t in full])
        bufs = ref.split_heads(rank_kv, IDS)
        for j, head in enumerate(heads):
            per_head[head] = bufs[j]
    assert sorted(per_head) == list(range(total))
    for consumer_tp in (1, 2, 8):
        for rank in range(consumer_tp):
            heads = kernels.rank_kv_heads(total, consumer_tp, rank)
            dst = [torch.full((2, NB, BS, len(heads), D), float("nan")).bfloat16() for _ in full]
            ref.merge_heads(torch.stack([per_head[h] for h in heads]), kernels.vllm_kv(dst), IDS)
            for t, x in zip(full, dst, strict=True):
                assert torch.equal(x[:, IDS], t[:, IDS, :, heads.start : heads.stop])


def test_split_heads_unit_is_one_head_of_one_block() -> None:
    paged, tensors = make_layout("vllm")
    bufs = ref.split_heads(paged, IDS)
    assert torch.equal(bufs[1, 2, 0, 1], tensors[0][1, IDS[2], :, 1])


@pytest.mark.parametrize("name", ["vllm", "vllm-mla", "trtllm"])
def test_block_first_head_buffers_hold_the_same_units_block_by_block(name: str) -> None:
    paged, _ = make_layout(name)
    head_major = ref.split_heads(paged, IDS)
    block_major = ref.split_heads(paged, IDS, block_major=True)
    assert block_major.shape == paged.geometry.head_buffer_shape(len(IDS), block_major=True)
    assert torch.equal(block_major, head_major.transpose(0, 1))
    # each block's heads are one contiguous run: block i is rows [i * H, (i + 1) * H)
    g = paged.geometry
    flat = block_major.reshape(len(IDS) * g.num_kv_heads, -1)
    assert torch.equal(flat[1 * g.num_kv_heads], head_major[0, 1].reshape(-1))
    fresh = torch.randn(*block_major.shape).bfloat16()
    ref.merge_heads(fresh, paged, [0, 5, 6, 11], block_major=True)
    assert torch.equal(ref.split_heads(paged, [0, 5, 6, 11], block_major=True), fresh)


def test_flashinfer_layout_is_the_flashattention_layout_with_kv_second() -> None:
    fa = [_rand(2, NB, BS, H, D) for _ in range(L)]
    fi = [t.transpose(0, 1).contiguous() for t in fa]  # [blocks, 2, bs, H, D]
    a = ref.split_heads(kernels.vllm_kv(fa), IDS)
    b = ref.split_heads(kernels.vllm_kv(fi, kv_dim=1), IDS)
    assert torch.equal(a, b)
    with pytest.raises(LayoutError):
        kernels.vllm_kv(fi, kv_dim=0)
    with pytest.raises(LayoutError):
        kernels.vllm_kv(fa, kv_dim=2)


def test_rank_kv_heads_splits_and_replicates() -> None:
    assert [kernels.rank_kv_heads(8, 4, r) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    assert [kernels.rank_kv_heads(2, 4, r) for r in range(4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]
    with pytest.raises(LayoutError):
        kernels.rank_kv_heads(6, 4, 0)


SPECS = [
    kernels.RopeSpec(D, neox=True),
    kernels.RopeSpec(D, neox=False),
    kernels.RopeSpec(D, neox=True, rotary_dim=8),
    kernels.RopeSpec(D, neox=False, rotary_dim=8, base=500000.0),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"neox={s.neox},r={s.rot_dim}")
def test_rerotate_forward_then_back_is_identity_within_bf16(spec: kernels.RopeSpec) -> None:
    paged, tensors = make_layout("vllm")
    before = [t.clone() for t in tensors]
    delta = torch.randint(-3000, 3000, (len(IDS) * BS,))
    ref.rerotate_blocks(paged, IDS, spec, delta)
    assert not torch.equal(tensors[0][0, IDS], before[0][0, IDS])
    ref.rerotate_blocks(paged, IDS, spec, -delta)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[1], b[1])  # V untouched
        torch.testing.assert_close(t[0].float(), b[0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"neox={s.neox},r={s.rot_dim}")
def test_rerotate_equals_rope_at_the_new_position(spec: kernels.RopeSpec) -> None:
    n = len(IDS)
    raw = torch.randn(n * BS, H, D)
    old = torch.arange(n * BS) + 7000  # chunk computed at a virtual position
    new = torch.arange(n * BS) + 3  # placed at its real position
    layers = [_rand(2, NB, BS, H, D) for _ in range(L)]
    k_old = kernels.apply_rope(raw, old, spec).bfloat16().view(n, BS, H, D)
    for t in layers:
        t[0, IDS] = k_old
    ref.rerotate_blocks(kernels.vllm_kv(layers), IDS, spec, new - old)
    expected = kernels.apply_rope(raw, new, spec).view(n, BS, H, D)
    for t in layers:
        torch.testing.assert_close(t[0, IDS].float(), expected, rtol=2e-2, atol=2e-2)


def test_scatter_with_rope_rotates_k_and_copies_v() -> None:
    spec = kernels.RopeSpec(D)
    paged, _ = make_layout("vllm")
    staging = _rand(*paged.geometry.staging_shape(len(IDS)))
    ref.scatter_blocks(staging, paged, IDS, rope=spec, delta=11)
    back = ref.gather_blocks(paged, IDS)
    assert torch.equal(back[:, :, 1], staging[:, :, 1])
    plain, _ = make_layout("vllm")
    ref.scatter_blocks(staging, plain, IDS)
    ref.rerotate_blocks(plain, IDS, spec, 11)
    assert torch.equal(ref.gather_blocks(plain, IDS), back)


def test_layout_errors() -> None:
    with pytest.raises(LayoutError):
        kernels.vllm_kv([torch.zeros(3, 4, 4, 2, 8)])
    paged, _ = make_layout("vllm")
    with pytest.raises(LayoutError):
        ref.scatter_blocks(torch.zeros(1, 2, 3, 4), paged, [0])


def test_dispatch_uses_reference_for_cpu_tensors() -> None:
    assert kernels.pick_backend(torch.device("cpu")) == "reference"
    paged, _ = make_layout("vllm")
    assert torch.equal(kernels.gather_blocks(paged, IDS), ref.gather_blocks(paged, IDS))


def test_dispatch_named_backend_that_cannot_import_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    paged, _ = make_layout("vllm")
    with pytest.raises(kernels.BackendUnavailable):
        kernels.gather_blocks(paged, IDS, backend="npu")
