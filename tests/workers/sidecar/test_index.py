"""The sidecar's chunk index: keys of one block found by (model, chunk hash), stale keys
forgotten, prefixes cut at the first gap."""

from __future__ import annotations

from ownerserve.kvstate.heads import HeadArtifactKey, head_keys
from workers.sidecar.index import ChunkId, ChunkIndex, chunk_of, stored_prefix, valid_key


def test_chunk_of_reads_every_head_artifact_key_shape() -> None:
    h = 0xDEADBEEF00112233
    assert chunk_of(HeadArtifactKey("org/model@v2", 3, h).to_string()) == ChunkId("org/model@v2", h)
    layered = HeadArtifactKey("m", 0, 5, pp_rank=1, layer=7).to_string()
    assert chunk_of(layered) == ChunkId("m", 5)
    assert chunk_of("plain-key") is None
    assert chunk_of("m@pcp0@dcp0@head:0@pp_rank:0@xyz") is None


def test_index_lists_present_keys_and_forgets_stale_ones() -> None:
    index = ChunkIndex()
    keys = head_keys("m", 9, range(4))
    for k in [*keys, "unindexed"]:
        index.add(k)
    assert len(index) == 1
    held = set(keys[:3])
    assert index.keys_of(ChunkId("m", 9), held.__contains__) == sorted(keys[:3])
    assert index.keys_of(ChunkId("other", 9), held.__contains__) == []
    assert index.keys_of(ChunkId("m", 9), lambda _: False) == []
    assert index.chunks() == []  # every key was stale: the chunk is gone


def test_a_block_is_listed_only_once_it_has_as_many_keys_as_declared() -> None:
    index = ChunkIndex()
    chunk = ChunkId("m", 9)
    keys = head_keys("m", 9, range(4))
    index.add(keys[0], 4)
    index.add(keys[1])  # undeclared: the largest declared count stands
    present = set(keys)
    assert index.keys_of(chunk, present.__contains__) == []
    index.add(keys[2], 2)
    index.add(keys[3], 4)
    assert index.keys_of(chunk, present.__contains__) == sorted(keys)
    present.discard(keys[3])  # evicted: the block is not whole any more
    assert index.keys_of(chunk, present.__contains__) == []
    assert index.keys_of(chunk, lambda _: False) == [] and index.chunks() == []
    index.add(keys[0])  # indexed again from scratch: the old count went with the chunk
    assert index.keys_of(chunk, present.__contains__) == [keys[0]]


def test_stored_prefix_stops_at_the_first_block_without_artifacts() -> None:
    assert stored_prefix([["a"], ["b", "c"], [], ["d"]]) == 2
    assert stored_prefix([["a"]]) == 1
    assert stored_prefix([]) == 0


def test_valid_key() -> None:
    assert valid_key("m@pcp0@dcp0@head:0@pp_rank:0@0000000000000001")
    assert not valid_key("")
    assert not valid_key("a\nb")
    assert not valid_key("x" * 1025)
