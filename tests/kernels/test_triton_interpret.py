"""The Triton kernels on CPU tensors under TRITON_INTERPRET=1, on tiny shapes, against the
reference. Skipped when triton is not importable."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import kernels
from kernels import reference as ref
from tests.kernels.test_reference import BS, IDS, LAYOUTS, SPECS, make_layout

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tri() -> Iterator[ModuleType]:
    """kernels.triton.ops with its kernels re-decorated for the interpreter, restored after."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    jit = importlib.reload(importlib.import_module("kernels.triton._jit"))
    ops = importlib.import_module("kernels.triton.ops")
    try:
        yield ops
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
        importlib.reload(jit)


@pytest.mark.parametrize("name", LAYOUTS)
def test_triton_gather_and_scatter_match_reference(tri: ModuleType, name: str) -> None:
    paged, tensors = make_layout(name)
    out = torch.full(paged.geometry.staging_shape(len(IDS)), float("nan")).bfloat16()
    tri.gather_blocks(paged, IDS, out)
    assert torch.equal(out, ref.gather_blocks(paged, IDS))

    staging = torch.randn(*out.shape).bfloat16()
    twin, twin_tensors = make_layout(name)
    for a, b in zip(twin_tensors, tensors, strict=True):
        a.copy_(b)
    tri.scatter_blocks(staging, paged, [1, 4, 11, 2])
    ref.scatter_blocks(staging, twin, [1, 4, 11, 2])
    for a, b in zip(tensors, twin_tensors, strict=True):
        assert torch.equal(a, b)


def test_triton_split_and_merge_match_reference(tri: ModuleType) -> None:
    paged, tensors = make_layout("vllm")
    bufs = tri.split_heads(paged, IDS)
    assert torch.equal(bufs, ref.split_heads(paged, IDS))
    fresh = torch.randn(*bufs.shape).bfloat16()
    before = [t.clone() for t in tensors]
    tri.merge_heads(fresh, paged, IDS)
    ref.merge_heads(fresh, kernels.vllm_kv(before), IDS)
    for a, b in zip(tensors, before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["vllm", "vllm-mla"])
def test_triton_block_first_split_and_merge_match_reference(tri: ModuleType, name: str) -> None:
    paged, tensors = make_layout(name)
    bufs = tri.split_heads(paged, IDS, block_major=True)
    assert torch.equal(bufs, ref.split_heads(paged, IDS, block_major=True))
    fresh = torch.randn(*bufs.shape).bfloat16()
    before = [t.clone() for t in tensors]
    tri.merge_heads(fresh, paged, IDS, block_major=True)
    twin = kernels.vllm_kv(before, mla=name == "vllm-mla")
    ref.merge_heads(fresh, twin, IDS, block_major=True)
    for a, b in zip(tensors, before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["vllm", "vllm-mla"])
@pytest.mark.parametrize(("flags", "first_head"), [([1, 1], 0), ([1, 0], 0), ([0, 1], 1)])
def test_triton_gated_merge_writes_the_verified_prefix_like_the_reference(
    tri: ModuleType, name: str, flags: list[int], first_head: int
) -> None:
    paged, tensors = make_layout(name)
    g = paged.geometry
    heads = g.num_kv_heads + first_head  # an object holding more heads than this rank's
    units = torch.randn(len(IDS), heads, g.num_layers, g.kv_factor, g.block_size, g.head_dim)
    units = units.bfloat16()
    group_of = [0, 0, 1, 1]
    before = [t.clone() for t in tensors]
    ok = torch.tensor(flags, dtype=torch.int32)
    tri.merge_heads_gated(units, paged, torch.tensor(IDS), ok, torch.tensor(group_of), first_head)
    twin = kernels.vllm_kv(before, mla=name == "vllm-mla")
    ref.merge_heads_gated(units, twin, IDS, ok, group_of, first_head)
    for a, b in zip(tensors, before, strict=True):
        assert torch.equal(a, b)
    # the reference itself: blocks of the prefix written, the others untouched
    written = ref.split_heads(twin, IDS, block_major=True)
    mine = units[:, first_head : first_head + g.num_kv_heads]
    prefix = 2 * (flags[0] != 0) * (1 + (flags[1] != 0))
    assert torch.equal(written[:prefix], mine[:prefix])
    assert not torch.equal(written[prefix:], mine[prefix:]) or prefix == len(IDS)


def test_triton_copy_blocks_trtllm_to_sglang(tri: ModuleType) -> None:
    src, _ = make_layout("trtllm")
    dst, _ = make_layout("sglang")
    tri.copy_blocks(src, dst, IDS, [0, 1, 2, 3])
    assert torch.equal(ref.gather_blocks(dst, [0, 1, 2, 3]), ref.gather_blocks(src, IDS))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"neox={s.neox},r={s.rot_dim}")
def test_triton_rerotate_in_place_matches_reference(
    tri: ModuleType, spec: kernels.RopeSpec
) -> None:
    paged, tensors = make_layout("vllm")
    twin = [t.clone() for t in tensors]
    delta = torch.randint(-3000, 3000, (len(IDS) * BS,))
    tri.rerotate_blocks(paged, IDS, spec, delta)
    ref.rerotate_blocks(kernels.vllm_kv(twin), IDS, spec, delta)
    for a, b in zip(tensors, twin, strict=True):
        assert torch.equal(a[1], b[1])
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("neox", [True, False])
def test_triton_scatter_with_rope_matches_reference(tri: ModuleType, neox: bool) -> None:
    spec = kernels.RopeSpec(16, neox=neox)
    paged, tensors = make_layout("vllm")
    twin = [t.clone() for t in tensors]
    staging = torch.randn(*paged.geometry.staging_shape(len(IDS))).bfloat16()
    tri.scatter_blocks(staging, paged, IDS, rope=spec, delta=-77)
    ref.scatter_blocks(staging, kernels.vllm_kv(twin), IDS, rope=spec, delta=-77)
    for a, b in zip(tensors, twin, strict=True):
        assert torch.equal(a[1], b[1])
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=2e-2)
