"""The dispatched (Triton) kernels on a CUDA GPU against the reference; skipped without a GPU.
The full-size check and timing is `bench/kernels/gpu_check.py`."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

L, NB, BS, H, D = 4, 64, 16, 4, 128


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")


def _ids(n: int) -> torch.Tensor:
    return torch.randperm(NB, device="cuda")[:n]


def test_dispatch_picks_triton_for_cuda_tensors() -> None:
    assert kernels.pick_backend(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("layout", ["vllm", "sglang", "trtllm", "mla"])
def test_gather_scatter_match_reference_on_gpu(layout: str) -> None:
    if layout == "vllm":
        paged = kernels.vllm_kv([_rand(2, NB, BS, H, D) for _ in range(L)])
    elif layout == "sglang":
        k = [_rand(NB * BS, H, D) for _ in range(L)]
        paged = kernels.sglang_kv(k, [_rand(NB * BS, H, D) for _ in range(L)], BS)
    elif layout == "trtllm":
        paged = kernels.trtllm_kv(_rand(NB, L, 2, H, BS, D))
    else:
        paged = kernels.vllm_kv([_rand(NB, BS, 576) for _ in range(L)], mla=True)
    ids = _ids(20)
    out = torch.full(paged.geometry.staging_shape(20), float("nan"), device="cuda").bfloat16()
    kernels.gather_blocks(paged, ids, out)
    assert torch.equal(out, ref.gather_blocks(paged, ids))
    staging = torch.randn_like(out)
    kernels.scatter_blocks(staging, paged, ids)
    assert torch.equal(ref.gather_blocks(paged, ids), staging)


def test_split_merge_match_reference_on_gpu() -> None:
    paged = kernels.vllm_kv([_rand(2, NB, BS, H, D) for _ in range(L)])
    ids = _ids(9)
    bufs = kernels.split_heads(paged, ids)
    assert torch.equal(bufs, ref.split_heads(paged, ids))
    fresh = torch.randn_like(bufs)
    kernels.merge_heads(fresh, paged, ids)
    assert torch.equal(ref.split_heads(paged, ids), fresh)


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_block_first_split_merge_match_reference_on_gpu(kv_dim: int) -> None:
    shape = (2, NB, BS, H, D) if kv_dim == 0 else (NB, 2, BS, H, D)
    paged = kernels.vllm_kv([_rand(*shape) for _ in range(L)], kv_dim=kv_dim)
    ids = _ids(9)
    bufs = kernels.split_heads(paged, ids, block_major=True)
    assert torch.equal(bufs, ref.split_heads(paged, ids, block_major=True))
    fresh = torch.randn_like(bufs)
    kernels.merge_heads(fresh, paged, ids, block_major=True)
    assert torch.equal(ref.split_heads(paged, ids, block_major=True), fresh)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 64])
def test_rerotate_matches_reference_on_gpu(neox: bool, rotary_dim: int | None) -> None:
    spec = kernels.RopeSpec(D, neox=neox, rotary_dim=rotary_dim)
    layers = [_rand(2, NB, BS, H, D) for _ in range(L)]
    twin = [t.clone() for t in layers]
    ids = _ids(12)
    delta = torch.randint(-5000, 5000, (12 * BS,), device="cuda")
    kernels.rerotate_blocks(kernels.vllm_kv(layers), ids, spec, delta)
    ref.rerotate_blocks(kernels.vllm_kv(twin), ids, spec, delta)
    for a, b in zip(layers, twin, strict=True):
        assert torch.equal(a[1], b[1])
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=2e-2)
