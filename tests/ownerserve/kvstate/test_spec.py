"""KV state sizes of the shipped specs, pinned against hand-computed bytes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ownerserve.kvstate import (
    MUTABLE_TYPES,
    SEALED_TYPES,
    AttentionType,
    DType,
    KVStateSpec,
    LayerSpec,
    StateType,
    artifact_id,
    load_spec,
)
from ownerserve.profiles import load_profile

MIB = 2**20
SHIPPED_SPECS = {"llama3-8b", "deepseek-v3", "deepseek-v3.2", "qwen3-8b-swa", "deepseek-v4"}


def test_llama3_8b_is_128_kib_per_token_as_the_shared_profile_says() -> None:
    spec = load_spec("llama3-8b")
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 B (bf16)
    assert spec.bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert spec.bytes_per_token() == load_profile("h100-llama3-8b").kv_bytes_per_token
    assert spec.state_types == (StateType.DENSE_KV,)
    assert spec.state_bytes(0, 1000) == {StateType.DENSE_KV: 1000 * 131072}
    assert spec.kv_heads == 8


def test_deepseek_v3_mla_is_656_bytes_per_layer_in_fp8() -> None:
    spec = load_spec("deepseek-v3")
    # 512 latent dims fp8 + 4 fp32 scales + 64 rope dims bf16, one latent (K = V), 61 layers
    per_layer = 512 * 1 + 16 + 64 * 2
    assert spec.layers[0].entry_bytes == per_layer == 656
    assert spec.bytes_per_token() == 61 * 656 == 40016
    assert spec.count(AttentionType.MLA) == 61
    assert spec.kv_heads == 1


def test_deepseek_v3_2_adds_the_lightning_indexer_key() -> None:
    spec = load_spec("deepseek-v3.2")
    # MLA 656 B + indexer key 128 fp8 dims + one fp32 scale = 132 B, per layer, no compression
    assert spec.bytes_per_token() == 61 * (656 + 132) == 48068
    got = spec.state_bytes(0, 10)
    assert got[StateType.COMPRESSED_CSA_MAIN] == 10 * 61 * 656
    assert got[StateType.COMPRESSED_CSA_INDEX] == 10 * 61 * 132
    assert StateType.TAIL_STATE not in got  # m = 1: nothing is ever pending


def test_qwen3_hybrid_keeps_dense_kv_only_on_full_layers_and_windows_elsewhere() -> None:
    spec = load_spec("qwen3-8b-swa")
    assert spec.count(AttentionType.DENSE) == 9 and spec.count(AttentionType.SWA) == 27
    assert spec.layers[3].attention is AttentionType.DENSE
    assert spec.bytes_per_token() == 9 * 2 * 8 * 128 * 2 == 36864
    # windows hold min(4096, n) tokens of 4096 B on 27 layers
    assert spec.swa_bytes(1000) == 27 * 1000 * 4096
    assert spec.swa_bytes(10**6) == 27 * 4096 * 4096 == 432 * MIB
    assert spec.swa_recompute_tokens == 4096 * 27
    assert spec.state_block_bytes == 432 * MIB


def test_deepseek_v4_sizes_per_state_type_by_hand() -> None:
    spec = load_spec("deepseek-v4")
    assert spec.count(AttentionType.CSA) == 30 and spec.count(AttentionType.HCA) == 31
    assert spec.block_tokens == 128  # lcm(4, 128)
    entry = 448 + 64 * 2  # fp8 dims + bf16 rope dims
    index = 128 // 2 + 4  # fp4 indexer key + scales
    assert spec.bytes_per_token() == 30 * (entry + index) / 4 + 31 * entry / 128 == 4969.5
    got = spec.state_bytes(0, 1000)
    assert got == {
        StateType.COMPRESSED_CSA_MAIN: 30 * (1000 // 4) * entry,
        StateType.COMPRESSED_CSA_INDEX: 30 * (1000 // 4) * index,
        StateType.COMPRESSED_HCA: 31 * (1000 // 128) * entry,
        StateType.WINDOW_SWA: 61 * 128 * entry,
        # CSA: 0 pending + the previous group (overlap) x 5120 B; HCA: 1000 % 128 = 104 pending
        StateType.TAIL_STATE: 30 * 4 * 5120 + 31 * 104 * 2048,
    }
    assert spec.swa_recompute_tokens == 128 * 61 == 7808


def test_v4_kv_at_1m_context_is_about_a_tenth_of_v3() -> None:
    n = 2**20
    v4 = load_spec("deepseek-v4").total_bytes(n)
    v3 = load_spec("deepseek-v3").total_bytes(n)
    v32 = load_spec("deepseek-v3.2").total_bytes(n)
    assert v4 == 5_216_010_240  # 4.86 GiB: 4969.5 B/token + 4.3 MiB windows + tails
    assert v3 == 41_959_817_216  # 39.08 GiB
    assert v32 == 50_402_951_168  # 46.94 GiB (the report's "~50 GB")
    assert v4 / v3 == pytest.approx(0.1243, abs=1e-4)  # about 1/8
    assert v4 / v32 == pytest.approx(0.1035, abs=1e-4)  # the report's "10% of V3.2"
    assert 0.08 < v4 / v3 < 0.15


def test_sealed_tokens_and_the_incomplete_block() -> None:
    spec = load_spec("deepseek-v4")
    assert spec.sealed_tokens(1000) == 896 and spec.tail_tokens(1000) == 104
    assert spec.sealed_tokens(1024) == 1024 and spec.tail_tokens(1024) == 0
    assert load_spec("llama3-8b").sealed_tokens(1000) == 992


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3.2", "qwen3-8b-swa", "deepseek-v4"])
@pytest.mark.parametrize("split", [0, 1, 127, 128, 501, 4096])
def test_sealed_bytes_of_ranges_add_up(name: str, split: int) -> None:
    spec = load_spec(name)
    end = 10_000

    def sealed(a: int, b: int) -> int:
        return sum(v for t, v in spec.state_bytes(a, b).items() if t in SEALED_TYPES)

    assert sealed(0, split) + sealed(split, end) == sealed(0, end)
    assert spec.sealed_bytes(0, split) + spec.sealed_bytes(split, end) == spec.sealed_bytes(0, end)
    assert spec.sealed_bytes(split, end) == sealed(split, end)
    assert spec.total_bytes(end) == sum(spec.state_bytes(0, end).values())


def test_sealed_and_mutable_types_partition_the_state() -> None:
    assert set(StateType) == SEALED_TYPES | MUTABLE_TYPES
    assert not SEALED_TYPES & MUTABLE_TYPES
    v4 = load_spec("deepseek-v4")
    assert set(v4.state_types) & MUTABLE_TYPES == {StateType.WINDOW_SWA, StateType.TAIL_STATE}
    assert v4.mutable_bytes(1000) == v4.swa_bytes(1000) + v4.tail_bytes(1000)


def test_average_bytes_per_token_for_a_given_context_includes_session_state() -> None:
    spec = load_spec("deepseek-v4")
    assert spec.bytes_per_token(1000) == spec.total_bytes(1000) / 1000
    assert spec.bytes_per_token(2**20) == pytest.approx(spec.bytes_per_token(), rel=1e-3)
    with pytest.raises(ValueError):
        spec.bytes_per_token(0)


def test_allocated_bytes_round_entries_up_to_kernel_alignment() -> None:
    v4 = load_spec("deepseek-v4")
    # 1000 tokens: CSA 250 entries -> 256, HCA 7 entries -> 64 (alignment 64 entries)
    csa = 30 * 256 * (576 + 68)
    hca = 31 * 64 * 576
    assert v4.allocated_bytes(1000) == csa + hca + v4.state_block_bytes
    llama = load_spec("llama3-8b")
    assert llama.allocated_bytes(1000) == 1008 * 131072


def test_invalid_token_ranges_are_rejected() -> None:
    spec = load_spec("llama3-8b")
    with pytest.raises(ValueError):
        spec.state_bytes(10, 5)
    with pytest.raises(ValueError):
        spec.sealed_bytes(-1, 5)


def _csa(**kw: object) -> LayerSpec:
    args: dict = dict(
        kind="csa",
        attention=AttentionType.CSA,
        kv_heads=1,
        head_dim=512,
        kv_tensors=1,
        compress_ratio=4,
        index_head_dim=128,
    )
    args.update(kw)
    return LayerSpec(**args)


def test_block_must_cover_every_compression_ratio() -> None:
    hca = LayerSpec("hca", AttentionType.HCA, 1, 512, kv_tensors=1, compress_ratio=128)
    with pytest.raises(ValueError, match="lcm"):
        KVStateSpec("bad", (_csa(), hca), block_tokens=64)
    assert KVStateSpec("ok", (_csa(), hca), block_tokens=256).block_tokens == 256


@pytest.mark.parametrize(
    "make",
    [
        lambda: _csa(index_head_dim=0),
        lambda: LayerSpec("w", AttentionType.SWA, 8, 128),
        lambda: LayerSpec("h", AttentionType.HCA, 1, 512, compress_ratio=1),
        lambda: LayerSpec("d", AttentionType.DENSE, 8, 128, compress_ratio=4),
        lambda: LayerSpec("d", AttentionType.DENSE, 8, 128, rope_dim=200),
        lambda: LayerSpec("d", AttentionType.DENSE, 0, 128),
        lambda: LayerSpec("d", AttentionType.DENSE, 8, 128, kv_tensors=3),
    ],
)
def test_inconsistent_layer_specs_are_rejected(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_layers_must_agree_on_kv_heads() -> None:
    a = LayerSpec("a", AttentionType.DENSE, 8, 128)
    b = LayerSpec("b", AttentionType.DENSE, 4, 128)
    with pytest.raises(ValueError, match="kv_heads"):
        KVStateSpec("bad", (a, b), block_tokens=16)


def test_fingerprint_tells_layouts_and_precisions_apart() -> None:
    a = LayerSpec("a", AttentionType.DENSE, 8, 128, dtype=DType.BF16)
    b = LayerSpec("a", AttentionType.DENSE, 8, 128, dtype=DType.FP8)
    fa = KVStateSpec("x", (a,), 16).fingerprint
    assert fa == KVStateSpec("y", (a,), 16).fingerprint  # the name is not the layout
    assert fa != KVStateSpec("x", (b,), 16).fingerprint
    assert load_spec("deepseek-v3").fingerprint != load_spec("deepseek-v3.2").fingerprint


def test_artifact_id_names_layout_precision_range_and_type_but_no_tp() -> None:
    v3, v32 = load_spec("deepseek-v3"), load_spec("deepseek-v3.2")
    a = artifact_id(v3, 0xABC, 0, 64)
    assert a == artifact_id(load_spec("deepseek-v3"), 0xABC, 0, 64)  # stable
    assert len(a) == 32
    others = {
        artifact_id(v32, 0xABC, 0, 64),  # other layout / precision
        artifact_id(v3, 0xABD, 0, 64),  # other prefix
        artifact_id(v3, 0xABC, 64, 128),  # other block range
        artifact_id(v3, 0xABC, 0, 64, tokenizer="byte"),
        artifact_id(v3, 0xABC, 0, 64, state=StateType.DENSE_KV),
    }
    assert a not in others and len(others) == 5


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(sorted(SHIPPED_SPECS)),
    cuts=st.lists(st.integers(0, 2_000_000), min_size=3, max_size=3),
)
def test_sealed_sizes_add_up_and_grow_with_the_prefix(name: str, cuts: list[int]) -> None:
    spec = load_spec(name)
    a, b, c = sorted(cuts)
    assert spec.sealed_bytes(a, b) + spec.sealed_bytes(b, c) == spec.sealed_bytes(a, c)
    assert spec.sealed_bytes(0, a) <= spec.sealed_bytes(0, c)
    assert 0 <= spec.mutable_bytes(c) <= spec.state_block_bytes
    assert spec.sealed_tokens(c) + spec.tail_tokens(c) == c
    assert spec.sealed_tokens(c) % spec.block_tokens == 0
