"""vLLM's KV event wire codec: decoding real vLLM 0.32 bytes, round trips, older array-form
events and malformed messages."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import pytest

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.types import Tier
from ownerserve.vllm_events import (
    KVEventWireError,
    decode_message,
    decode_payload,
    encode_message,
    encode_payload,
    engine_hash,
)

DATA = Path(__file__).parent / "data"


def test_decodes_a_batch_captured_from_vllm_0_32() -> None:
    batch = decode_payload((DATA / "vllm-0.32-kv-event-batch.msgpack").read_bytes(), seq=0)
    assert batch.seq == 0
    assert len(batch.events) == 1
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_size == 32
    assert len(ev.engine_hashes) == 3
    assert len(ev.token_ids) == 3 * 32
    assert ev.parent_engine_hash is None
    assert ev.tier is Tier.GPU


def test_round_trip_keeps_every_field() -> None:
    events = (
        BlockStored((1, 2), None, tuple(range(64)), 32),
        BlockStored((3,), 2, tuple(range(64, 96)), 32, tier=Tier.CPU, lora_id=7),
        BlockRemoved((1,), tier=Tier.CPU),
        AllBlocksCleared(),
    )
    batch = EventBatch(seq=41, ts=123.5, events=events)
    out = decode_message(encode_message(batch, topic=b"kv"))
    assert out == batch


def test_group_fields_round_trip_and_single_group_events_omit_them() -> None:
    events = (
        BlockStored((1,), None, tuple(range(16)), 16, group_idx=0, group_kind="full_attention"),
        BlockStored(
            (1,), None, tuple(range(16)), 16, group_idx=3, group_kind="sliding_window",
            sliding_window=128,
        ),
        BlockRemoved((1,), group_idx=3),
    )  # fmt: skip
    batch = EventBatch(seq=2, ts=1.0, events=events)
    assert decode_message(encode_message(batch)) == batch
    # a dense engine's events are written as before: no group keys on the wire
    plain = msgpack.unpackb(encode_payload([BlockStored((1,), None, (0,) * 16, 16)]))
    assert "group_idx" not in plain[1][0]


def test_group_fields_of_vllm_tagged_maps_and_arrays_decode() -> None:
    raw = [
        {
            "type": "BlockStored", "block_hashes": [9], "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, "medium": "GPU",
            "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 4096,
        },
        ["BlockStored", [9], None, list(range(16)), 16, None, "GPU", None, None, 2, "mamba"],
        ["BlockRemoved", [9], "GPU", 1],
    ]  # fmt: skip
    ev = decode_payload(msgpack.packb([1.0, raw, 0]), seq=0).events
    assert ev[0] == BlockStored(
        (9,), None, tuple(range(16)), 16, group_idx=1, group_kind="sliding_window",
        sliding_window=4096,
    )  # fmt: skip
    assert isinstance(ev[1], BlockStored) and (ev[1].group_idx, ev[1].group_kind) == (2, "mamba")
    assert ev[2] == BlockRemoved((9,), group_idx=1)
    with pytest.raises(KVEventWireError):
        decode_payload(msgpack.packb([1.0, [["BlockRemoved", [9], "GPU", "x"]], 0]), seq=0)


def test_sha256_digest_hashes_decode_to_vllms_int_form() -> None:
    digest = hashlib.sha256(b"block").digest()
    as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    raw = {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}
    batch = decode_payload(msgpack.packb([1.0, [raw], 0]), seq=3)
    assert batch.events == (BlockRemoved((as_int,)),)
    assert engine_hash(as_int) == as_int


def test_array_form_events_of_older_vllm_decode() -> None:
    raw = [
        ["BlockStored", [5], 4, list(range(16)), 16, None, "CPU"],
        ["BlockRemoved", [5], None],
        ["AllBlocksCleared"],
        ["SomethingNew", 1, 2],
    ]
    batch = decode_payload(msgpack.packb([2.0, raw, 0]), seq=9)
    assert batch.events == (
        BlockStored((5,), 4, tuple(range(16)), 16, tier=Tier.CPU),
        BlockRemoved((5,)),
        AllBlocksCleared(),
    )


@pytest.mark.parametrize(
    "frames",
    [
        [b"t", (0).to_bytes(8, "big")],
        [b"t", b"\x00", encode_payload([])],
        [b"t", (0).to_bytes(8, "big"), b"\xc1"],
        [b"t", (0).to_bytes(8, "big"), msgpack.packb({"not": "a batch"})],
    ],
)
def test_malformed_messages_raise_wire_errors(frames: list[bytes]) -> None:
    with pytest.raises(KVEventWireError):
        decode_message(frames)
