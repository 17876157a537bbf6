"""Per-KV-head artifact keys: KV stored by one TP size is found by consumers of another."""

from collections.abc import Sequence

import pytest

from ownerserve.kvstate import (
    HeadArtifactKey,
    StateType,
    head_keys,
    heads_for_rank,
    load_spec,
    matched_chunks,
    matched_chunks_for_tp,
    store_heads_for_rank,
    store_keys_for_rank,
)

MODEL = "llama3-8b"
CHUNKS = [0xA1, 0xB2, 0xC3]


def test_heads_split_evenly_over_ranks() -> None:
    assert heads_for_rank(8, 4, 1) == (2, 3)
    assert heads_for_rank(8, 2, 1) == (4, 5, 6, 7)
    assert heads_for_rank(8, 8, 5) == (5,)
    assert heads_for_rank(32, 4, 0) == tuple(range(8))  # 32 heads over TP 4: rank 0


def test_tp_above_kv_heads_replicates_heads_and_only_the_first_replica_stores() -> None:
    # TP=16 over 8 heads: ranks 2k and 2k+1 both hold head k, as vLLM replicates
    assert [heads_for_rank(8, 16, r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert store_heads_for_rank(8, 16, 2) == (1,)
    assert store_heads_for_rank(8, 16, 3) == ()


def test_mla_keeps_one_head_on_every_rank() -> None:
    heads = load_spec("deepseek-v3").kv_heads
    assert heads == 1
    assert {heads_for_rank(heads, 8, r) for r in range(8)} == {(0,)}
    assert [store_heads_for_rank(heads, 4, r) for r in range(4)] == [(0,), (), (), ()]


@pytest.mark.parametrize(("heads", "tp", "rank"), [(8, 3, 0), (8, 12, 0), (8, 4, 4), (0, 1, 0)])
def test_impossible_head_layouts_are_rejected(heads: int, tp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        heads_for_rank(heads, tp, rank)


def test_key_format_follows_the_seed_with_head_instead_of_tp_rank() -> None:
    key = HeadArtifactKey(MODEL, head=3, chunk_hash=0xAB)
    assert key.to_string() == "llama3-8b@pcp0@dcp0@head:3@pp_rank:0@00000000000000ab"
    layered = key.split_layers(2)
    assert [k.to_string()[-2:] for k in layered] == ["@0", "@1"]
    typed = HeadArtifactKey(MODEL, 0, 1, state=StateType.COMPRESSED_HCA).to_string()
    assert typed.endswith("@hca")


def _stored_by(tp: int, heads: int = 8) -> set[str]:
    keys: set[str] = set()
    for rank in range(tp):
        keys.update(store_keys_for_rank(MODEL, CHUNKS, heads, tp, rank))
    return keys


def test_a_prefix_stored_by_tp4_is_complete_for_tp8_and_tp2_consumers() -> None:
    heads = load_spec(MODEL).kv_heads
    store = _stored_by(4, heads)
    assert len(store) == len(CHUNKS) * heads  # one key per head and chunk, whatever the TP
    assert store == _stored_by(8, heads) == _stored_by(2, heads)  # identity independent of TP
    for tp in (8, 2, 16):
        assert matched_chunks_for_tp(store, MODEL, CHUNKS, heads, tp) == 3
        for rank in range(tp):
            needed = heads_for_rank(heads, tp, rank)
            assert matched_chunks(store, MODEL, CHUNKS, needed) == 3


def test_one_missing_head_makes_the_prefix_incomplete_from_that_chunk() -> None:
    store = _stored_by(4)
    store.discard(HeadArtifactKey(MODEL, head=5, chunk_hash=CHUNKS[1]).to_string())
    assert matched_chunks_for_tp(store, MODEL, CHUNKS, 8, 8) == 1
    assert matched_chunks_for_tp(store, MODEL, CHUNKS, 8, 2) == 1
    # the rank that needs head 5 sees the gap; a rank that doesn't still sees all three
    assert matched_chunks(store, MODEL, CHUNKS, heads_for_rank(8, 8, 5)) == 1
    assert matched_chunks(store, MODEL, CHUNKS, heads_for_rank(8, 8, 0)) == 3
    assert matched_chunks(store, MODEL, CHUNKS, heads_for_rank(8, 2, 1)) == 1


def test_lookup_checks_every_pipeline_stage() -> None:
    store = set()
    for pp in (0, 1):
        for c in CHUNKS:
            store.update(head_keys(MODEL, c, range(8), pp_ranks=(pp,)))
    assert matched_chunks_for_tp(store, MODEL, CHUNKS, 8, 4, pp_size=2) == 3
    store.discard(HeadArtifactKey(MODEL, 0, CHUNKS[0], pp_rank=1).to_string())
    assert matched_chunks_for_tp(store, MODEL, CHUNKS, 8, 4, pp_size=2) == 0
    assert matched_chunks_for_tp(store, MODEL, CHUNKS, 8, 4, pp_size=1) == 3


def test_lookup_asks_a_batch_existence_check_once() -> None:
    store = _stored_by(4)
    calls: list[int] = []

    def exists(keys: Sequence[str]) -> list[bool]:
        calls.append(len(keys))
        return [k in store for k in keys]

    assert matched_chunks_for_tp(exists, MODEL, CHUNKS, 8, 8) == 3
    assert calls == [len(CHUNKS) * 8]
