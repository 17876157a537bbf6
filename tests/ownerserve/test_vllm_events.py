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
