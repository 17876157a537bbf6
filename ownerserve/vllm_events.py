"""vLLM's KV event wire format: the one codec for it in the project. The router's subscriber
(`router.backends.kv_events`) decodes what real vLLM publishes and the emulated engine encodes
with the same functions.

The format (vllm 0.32, `vllm/distributed/kv_events.py`): ZMQ multipart `[topic, seq, payload]`,
`seq` an 8-byte big-endian counter per publisher starting at 0, `payload` a msgpack `EventBatch`
array `[ts, [event, ...], data_parallel_rank]`. Events are msgspec tagged structs: maps with a
`type` key (`{"type": "BlockStored", "block_hashes": [...], ...}`); older vLLM sent them as
arrays `["BlockStored", block_hashes, ...]`, which `decode_payload` accepts too. Block hashes are
32-byte sha256 digests by default (or ints with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`); both
decode to the same 64-bit int vLLM itself derives (big-endian, low 64 bits). An engine with
several KV cache groups (hybrid attention) tags each group's events with `group_idx`,
`kv_cache_spec_kind` and `kv_cache_spec_sliding_window`; events without them are a
single-group engine's and are encoded without them, as before.

Replay: when the publisher has a `replay_endpoint` (a ROUTER socket), a client sends
`[b"", start_seq(8 bytes big-endian)]` from a DEALER and gets every buffered batch with
`seq >= start_seq` as `[b"", topic, seq, payload]`, then an end marker whose seq is `END_SEQ`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from ownerserve.types import Tier

_MASK64 = (1 << 64) - 1
END_SEQ = -1
_MEDIUM_TO_TIER = {"GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.SSD, "DISK": Tier.SSD}
_TIER_TO_MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.SSD: "STORAGE"}


class KVEventWireError(ValueError):
    """A message that is not a vLLM KV event batch."""


def engine_hash(value: bytes | int) -> int:
    """A vLLM external block hash as the 64-bit int vLLM itself derives from its digest."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _MASK64
    if isinstance(value, int):
        return value & _MASK64
    raise KVEventWireError(f"block hash of type {type(value).__name__}")


def tier_of(medium: str | None) -> Tier:
    """vLLM's `medium` ("GPU", "CPU", "STORAGE"; None means the device cache) as a tier."""
    if medium is None:
        return Tier.GPU
    return _MEDIUM_TO_TIER.get(str(medium).upper(), Tier.GPU)


def _event_fields(raw: Any) -> tuple[str, Mapping[str, Any] | Sequence[Any]]:
    if isinstance(raw, Mapping):
        return str(raw.get("type", "")), raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        return raw[0], raw[1:]
    raise KVEventWireError(f"unrecognised event {raw!r:.80}")


def _field(fields: Mapping[str, Any] | Sequence[Any], name: str, pos: int) -> Any:
    if isinstance(fields, Mapping):
        return fields.get(name)
    return fields[pos] if pos < len(fields) else None


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventWireError(f"expected an integer, got {value!r:.40}")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def decode_event(raw: Any) -> KVEvent | None:
    """One wire event as a core event; None for event kinds this codec does not know."""
    kind, f = _event_fields(raw)
    if kind == "BlockStored":
        parent = _field(f, "parent_block_hash", 1)
        return BlockStored(
            engine_hashes=tuple(engine_hash(h) for h in _field(f, "block_hashes", 0) or ()),
            parent_engine_hash=None if parent is None else engine_hash(parent),
            token_ids=tuple(int(t) for t in _field(f, "token_ids", 2) or ()),
            block_size=int(_field(f, "block_size", 3) or 0),
            tier=tier_of(_field(f, "medium", 5)),
            lora_id=_field(f, "lora_id", 4),
            group_idx=_opt_int(_field(f, "group_idx", 8)),
            group_kind=_opt_str(_field(f, "kv_cache_spec_kind", 9)),
            sliding_window=_opt_int(_field(f, "kv_cache_spec_sliding_window", 10)),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            engine_hashes=tuple(engine_hash(h) for h in _field(f, "block_hashes", 0) or ()),
            tier=tier_of(_field(f, "medium", 1)),
            group_idx=_opt_int(_field(f, "group_idx", 2)),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """A msgpack `EventBatch` payload as a core batch (unknown event kinds are skipped)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVEventWireError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise KVEventWireError(f"payload is not an EventBatch array: {raw!r:.80}")
    events = []
    for item in raw[1]:
        event = decode_event(item)
        if event is not None:
            events.append(event)
    return EventBatch(seq=seq, ts=float(raw[0]), events=tuple(events))


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed, so the replay end marker reads -1)."""
    if len(frame) != 8:
        raise KVEventWireError(f"seq frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """A published multipart message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise KVEventWireError(f"expected 3 frames, got {len(frames)}")
    return decode_payload(frames[2], decode_seq(frames[1]))


def encode_event(event: KVEvent) -> dict[str, Any]:
    """A core event in vLLM 0.32's tagged-map form (hashes as ints)."""
    out: dict[str, Any]
    if isinstance(event, BlockStored):
        out = {
            "type": "BlockStored",
            "block_hashes": list(event.engine_hashes),
            "parent_block_hash": event.parent_engine_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": _TIER_TO_MEDIUM[event.tier],
            "lora_name": None,
        }
        if event.group_idx is not None:  # a single-group engine's events stay as they were
            out["group_idx"] = event.group_idx
            out["kv_cache_spec_kind"] = event.group_kind
            out["kv_cache_spec_sliding_window"] = event.sliding_window
        return out
    if isinstance(event, BlockRemoved):
        out = {
            "type": "BlockRemoved",
            "block_hashes": list(event.engine_hashes),
            "medium": _TIER_TO_MEDIUM[event.tier],
        }
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def encode_payload(
    events: Iterable[KVEvent], ts: float | None = None, data_parallel_rank: int = 0
) -> bytes:
    """A msgpack `EventBatch` payload, as vLLM's publisher writes it."""
    stamp = time.time() if ts is None else ts
    body = [stamp, [encode_event(e) for e in events], data_parallel_rank]
    return bytes(msgpack.packb(body, use_bin_type=True))


def encode_message(batch: EventBatch, topic: bytes = b"") -> list[bytes]:
    """The multipart message `[topic, seq, payload]` for one batch."""
    return [topic, batch.seq.to_bytes(8, "big"), encode_payload(batch.events, batch.ts)]
