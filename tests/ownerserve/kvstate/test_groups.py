"""KV cache groups of each shipped spec: bytes per group against hand-computed values, sealing
at ratio boundaries, and the split adding up to the spec's per-type sizes."""

from __future__ import annotations

import pytest

from ownerserve.kvstate import StateType, list_specs, load_spec
from ownerserve.kvstate.groups import (
    GroupKind,
    bytes_by_state_type,
    is_hybrid,
    kv_cache_groups,
    sealed_block_bytes,
)


def _by_type(name: str) -> dict[tuple[GroupKind, StateType], tuple[int, int, int]]:
    return {
        (g.kind, g.state_type): (g.layers, g.entry_bytes, g.block_bytes)
        for g in kv_cache_groups(load_spec(name))
    }


def test_llama3_is_one_full_attention_group_of_32_layers() -> None:
    groups = kv_cache_groups(load_spec("llama3-8b"))
    assert len(groups) == 1 and not is_hybrid(groups)
    g = groups[0]
    # 2 (K, V) x 8 heads x 128 dims x 2 B = 4096 B per layer and token; 16 tokens a block
    assert (g.kind, g.layers, g.entry_bytes, g.block_bytes) == (
        GroupKind.FULL,
        32,
        4096,
        32 * 16 * 4096,
    )
    assert g.sealed and g.index == 0


def test_qwen3_swa_has_a_full_group_and_a_window_group() -> None:
    got = _by_type("qwen3-8b-swa")
    assert got == {
        (GroupKind.FULL, StateType.DENSE_KV): (9, 4096, 9 * 16 * 4096),
        (GroupKind.SLIDING_WINDOW, StateType.WINDOW_SWA): (27, 4096, 27 * 16 * 4096),
    }
    swa = kv_cache_groups(load_spec("qwen3-8b-swa"))[1]
    assert not swa.sealed and swa.window == 4096 and swa.window_blocks == 4096 // 16
    # the window holds min(4096, n) entries per layer
    assert swa.bytes(100) == 27 * 100 * 4096
    assert swa.bytes(10_000) == 27 * 4096 * 4096


def test_deepseek_v4_groups_by_hand() -> None:
    got = _by_type("deepseek-v4")
    got.pop((GroupKind.STATE, StateType.TAIL_STATE))  # two tail groups: checked below
    # entry: 448 FP8 dims + 64 BF16 RoPE dims = 448 + 128 = 576 B; indexer 128 FP4 + 4 = 68 B
    assert got == {
        (GroupKind.COMPRESSED, StateType.COMPRESSED_CSA_MAIN): (30, 576, 30 * (128 // 4) * 576),
        (GroupKind.COMPRESSED, StateType.COMPRESSED_HCA): (31, 576, 31 * 1 * 576),
        (GroupKind.INDEXER, StateType.COMPRESSED_CSA_INDEX): (30, 68, 30 * 32 * 68),
        # one window group over all 61 layers (CSA's and HCA's branches alike)
        (GroupKind.SLIDING_WINDOW, StateType.WINDOW_SWA): (61, 576, 61 * 128 * 576),
    }
    # two tails: CSA (m=4, overlapping: at most 3 + 4 pending) and HCA (m'=128: 127)
    groups = kv_cache_groups(load_spec("deepseek-v4"))
    tails = [g for g in groups if g.kind is GroupKind.STATE]
    assert sorted((g.layers, g.entry_bytes, g.ratio, g.block_bytes) for g in tails) == [
        (30, 5120, 4, 30 * 7 * 5120),
        (31, 2048, 128, 31 * 127 * 2048),
    ]
    # sealed bytes of one 128-token block: 552960 + 17856 + 65280 = 636096 = 128 x 4969.5
    assert sealed_block_bytes(groups) == 636096 == int(128 * 4969.5)
    assert groups[0].sealed and [g.index for g in groups] == list(range(len(groups)))


def test_compressed_entries_seal_at_ratio_boundaries() -> None:
    groups = kv_cache_groups(load_spec("deepseek-v4"))
    csa = next(g for g in groups if g.state_type is StateType.COMPRESSED_CSA_MAIN)
    hca = next(g for g in groups if g.state_type is StateType.COMPRESSED_HCA)
    assert [csa.entries(n) for n in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
    assert [hca.entries(n) for n in (127, 128, 255, 256)] == [0, 1, 1, 2]
    tail = next(g for g in groups if g.kind is GroupKind.STATE and g.ratio == 4)
    # pending: n % 4, plus the previous group of 4 (overlap) once one is complete
    assert [tail.entries(n) for n in (0, 3, 4, 5, 128)] == [0, 3, 4, 5, 4]


@pytest.mark.parametrize("name", list_specs())
@pytest.mark.parametrize("n", [0, 1, 15, 16, 127, 128, 129, 4096, 100_000, 1 << 20])
def test_group_bytes_add_up_to_the_spec_state_bytes(name: str, n: int) -> None:
    spec = load_spec(name)
    assert bytes_by_state_type(kv_cache_groups(spec), n) == spec.state_bytes(0, n)


def test_block_size_must_be_a_multiple_of_the_spec_block() -> None:
    spec = load_spec("deepseek-v4")
    assert kv_cache_groups(spec, 256)[0].block_tokens == 256
    with pytest.raises(ValueError, match="multiple"):
        kv_cache_groups(spec, 64)
