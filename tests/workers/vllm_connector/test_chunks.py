"""The connector's chunk reuse logic without vLLM: which tokens a chunked request loads from
which artifact, the artifact format, and K re-rotated to where the chunk sits."""

from __future__ import annotations

import pytest
import torch

from kernels import LayoutError
from kernels.rope import RopeSpec, apply_rope
from ownerserve.chunks import Chunk, LoadSpan, chunk_artifact_key, load_spans
from workers.vllm_connector.chunks import (
    ChunkArtifact,
    ChunkPiece,
    blocks_for,
    decode_artifact,
    encode_artifact,
    layout_of,
    place,
    plan_pieces,
    save_spec_of,
    tokens_of,
)

BS = 32
SPANS = (LoadSpan(45, 87, 0xA), LoadSpan(87, 116, 0xB), LoadSpan(116, 170, 0xC))


def key(k: int) -> str:
    return chunk_artifact_key("m", k)


def test_a_request_hitting_the_system_blocks_loads_the_system_tail_and_every_span() -> None:
    end, pieces = plan_pieces("m", 45, SPANS, [True] * 3, 32, 200, BS)
    assert end == 170
    assert pieces == [
        ChunkPiece(key(0xA), 0, 32, 13, 0),  # the system tail, from the first artifact
        ChunkPiece(key(0xA), 13, 45, 42, 0),  # the first span sits where it was computed
        ChunkPiece(key(0xB), 13, 87, 29, 87 - 45),
        ChunkPiece(key(0xC), 13, 116, 54, 116 - 45),
    ]


def test_only_the_leading_stored_spans_load_and_a_gap_stops_the_run() -> None:
    end, pieces = plan_pieces("m", 45, SPANS, [True, False, True], 32, 200, BS)
    assert end == 87 and [p.key for p in pieces] == [key(0xA)] * 2


def test_without_the_system_blocks_or_with_the_last_token_in_a_chunk_nothing_loads() -> None:
    assert plan_pieces("m", 45, SPANS, [True] * 3, 0, 200, BS) == (0, [])
    end, _ = plan_pieces("m", 45, SPANS, [True] * 3, 32, 170, BS)
    assert end == 116  # the third span holds the prompt's last token: computed


def test_a_local_hit_inside_a_span_loads_the_rest_of_it() -> None:
    end, pieces = plan_pieces("m", 45, SPANS, [True] * 3, 96, 200, BS)
    assert end == 170
    assert pieces[0] == ChunkPiece(key(0xB), 13 + 96 - 87, 96, 116 - 96, 87 - 45)


def test_an_artifact_round_trips_and_a_wrong_size_is_refused() -> None:
    kv = torch.randn(4, 2, 2, 10, 8)
    art = decode_artifact(encode_artifact(kv, 32, 45), 4, 2, 8, torch.float32)
    assert (art.start, art.position, art.system_tail) == (32, 45, 13)
    assert torch.equal(art.kv, kv)
    with pytest.raises(LayoutError):
        decode_artifact(encode_artifact(kv, 32, 45), 4, 3, 8, torch.float32)
    with pytest.raises(LayoutError):
        decode_artifact(b"junk" * 10, 4, 2, 8, torch.float32)


def test_placed_k_is_rotated_to_the_position_the_chunk_sits_at() -> None:
    rope = RopeSpec(8, neox=True, base=10000.0)
    h, layers, t, d = 2, 3, 20, 8
    raw_k, v = torch.randn(h, layers, t, d), torch.randn(h, layers, t, d)

    def rotated(k: torch.Tensor, first: int) -> torch.Tensor:  # [h, L, T, D] at first..
        x = k.permute(1, 2, 0, 3)  # [L, T, H, D]
        return apply_rope(x, torch.arange(first, first + t), rope).permute(2, 0, 1, 3)

    art = ChunkArtifact(0, 5, 5, torch.stack((rotated(raw_k, 5), v), dim=2))
    blocks = torch.zeros(h, 3, layers, 2, BS, d)
    first = 64  # blocks hold tokens 64..159
    place(blocks, first, ChunkPiece("k", 0, 70, t, 70 - 5), art, rope)
    got = tokens_of(blocks, first, 70, 70 + t)
    assert torch.allclose(got[:, :, 0], rotated(raw_k, 70), atol=1e-5)
    assert torch.equal(got[:, :, 1], v)
    assert not tokens_of(blocks, first, 64, 70).any()  # nothing outside the piece


def test_blocks_for_and_the_request_params() -> None:
    assert blocks_for([7, 8, 9, 10], 40, 70, BS) == (32, [8, 9])
    ids = list(range(100, 300))
    layout: dict[str, object] = {"chunks": [{"hash": "a" * 16, "start": 50, "end": 60}]}
    params = {"ownerserve": layout}
    assert layout_of(params, ids) is None  # no system_end: not a layout the connector uses
    layout["system_end"] = 45
    system_end, spans = layout_of(params, ids) or (0, ())
    assert system_end == 45
    assert spans == load_spans(ids, 45, (Chunk(50, 60, int("a" * 16, 16)),))
    assert spans[0].start == 45 and spans[0].key != int("a" * 16, 16)  # lead-in joins the key
    spec = {"key": "0" * 15 + "1", "start": 32, "end": 90, "position": 45}
    assert save_spec_of({"ownerserve": {"chunk_save": spec}}) is not None
    assert save_spec_of({"ownerserve": {"chunk_save": {**spec, "position": 95}}}) is None
