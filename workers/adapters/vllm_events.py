"""vLLM's KV event wire format, and a ZMQ subscriber that feeds a worker's events to the directory.

The one codec for that format in the project: the vLLM adapter decodes what real vLLM publishes
and the emulated engine encodes with the same functions. The format (vllm 0.32,
`vllm/distributed/kv_events.py`): ZMQ multipart `[topic, seq, payload]`, `seq` an 8-byte
big-endian counter per publisher starting at 0, `payload` a msgpack `EventBatch` array
`[ts, [event, ...], data_parallel_rank]`. Events are msgspec tagged structs: maps with a `type`
key (`{"type": "BlockStored", "block_hashes": [...], ...}`); older vLLM sent them as arrays
`["BlockStored", block_hashes, ...]`, which `decode_payload` accepts too. Block hashes are
32-byte sha256 digests by default (or ints with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`); both
decode to the same 64-bit int vLLM itself derives (big-endian, low 64 bits).

Replay: when the publisher has a `replay_endpoint` (a ROUTER socket), a client sends
`[b"", start_seq(8 bytes big-endian)]` from a DEALER and gets every buffered batch with
`seq >= start_seq` as `[b"", topic, seq, payload]`, then an end marker whose seq is -1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio

from ownerserve.directory.base import EventApplyResult
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import Tier

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
END_SEQ = -1
_MEDIUM_TO_TIER = {"GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.SSD, "DISK": Tier.SSD}
_TIER_TO_MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.SSD: "STORAGE"}


class KVEventWireError(ValueError):
    """A message that is not a vLLM KV event batch."""


# --- codec -------------------------------------------------------------------------------------


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
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            engine_hashes=tuple(engine_hash(h) for h in _field(f, "block_hashes", 0) or ()),
            tier=tier_of(_field(f, "medium", 1)),
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
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.engine_hashes),
            "parent_block_hash": event.parent_engine_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": _TIER_TO_MEDIUM[event.tier],
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.engine_hashes),
            "medium": _TIER_TO_MEDIUM[event.tier],
        }
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


# --- subscriber --------------------------------------------------------------------------------


class KVEventSink(Protocol):
    """Where decoded batches go; `ownerserve.directory.Directory` satisfies it."""

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult: ...

    async def drop_worker(self, worker: str) -> int: ...


@dataclass(slots=True)
class SubscriberStats:
    """What a subscriber has seen so far."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    malformed: int = 0
    skipped_blocks: int = 0
    """Stored blocks the sink could not map (block size mismatch or unknown parent)."""
    last_seq: int | None = None


class KVEventSubscriber:
    """Subscribes to one worker's KV event publisher and applies every batch to a sink in order.

    Sequence handling: a jump past the next expected seq is a gap, filled from the replay socket
    when the worker has one. A gap that replay cannot fill makes the worker's *cached blocks*
    unknown: the subscriber applies an `AllBlocksCleared` batch numbered just before the new
    one (the directory forgets what the worker caches, and takes the new batch without seeing
    another gap) and continues; the worker's artifacts, leases and session ownership stay, as
    the worker is alive. A lower seq with a newer timestamp means the engine restarted with an
    empty cache: the subscriber drops the worker (`sink.drop_worker`, which also resets the
    directory's sequence) and continues from the new batch. The first batch a subscriber sees
    without a replay socket is its starting point, not a gap (what was published before the
    subscription is unknowable; the directory still detects a jump from a seq it already
    applied). With a replay socket it also catches up on start (PUB/SUB loses whatever was
    published before the connection was up) and after `catch_up_interval_s` of silence (a lost
    last batch shows no gap until the next one arrives).

    `bind=True` binds `endpoint` and lets the publisher connect, which is how a vLLM instance
    configured with a non-wildcard endpoint (e.g. `tcp://127.0.0.1:PORT`) publishes.
    """

    def __init__(
        self,
        worker: str,
        endpoint: str,
        sink: KVEventSink,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        bind: bool = False,
        replay_timeout_s: float = 2.0,
        catch_up_interval_s: float | None = 5.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.catch_up_interval_s = catch_up_interval_s
        self.stats = SubscriberStats()
        self._sink = sink
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._expected: int | None = None
        self._last_ts = float("-inf")

    async def start(self) -> None:
        """Open the SUB socket and start consuming in a background task."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.worker}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        assert self._sub is not None
        # Batches published before the SUB connection was up are lost on PUB/SUB; fetch them.
        await self._guarded(self.catch_up())
        idle_ms = None
        if self.replay_endpoint is not None and self.catch_up_interval_s is not None:
            idle_ms = int(self.catch_up_interval_s * 1000)
        while True:
            if not await self._sub.poll(idle_ms):
                # Quiet for a while: a lost *last* batch shows no gap until the next one.
                await self._guarded(self.catch_up())
                continue
            frames = await self._sub.recv_multipart()
            try:
                batch = decode_message(frames)
            except KVEventWireError as exc:
                self.stats.malformed += 1
                log.warning("worker %s: malformed KV event message: %s", self.worker, exc)
                continue
            await self._guarded(self.handle(batch))

    async def _guarded(self, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception:
            log.exception("worker %s: applying KV events failed", self.worker)

    async def handle(self, batch: EventBatch) -> None:
        """Apply one received batch, filling or resyncing any gap before it."""
        if self._expected is not None and batch.seq < self._expected:
            if batch.ts <= self._last_ts:
                return  # a duplicate (replayed and also published)
            # Lower seq, newer timestamp: the engine restarted and its cache is empty.
            log.warning("worker %s: KV event seq restarted; dropping its blocks", self.worker)
            self.stats.resyncs += 1
            await self._sink.drop_worker(self.worker)
            self._expected = None
        start = 0 if self._expected is None else self._expected
        if batch.seq != start and (self._expected is not None or self.replay_endpoint):
            self.stats.gaps += self._expected is not None
            got = await self._fetch_replay(start, stop=batch.seq)
            if got and [b.seq for b in got] == list(range(got[0].seq, batch.seq)):
                if got[0].seq != start and self._expected is not None:
                    await self._lost(start, got[0].seq)
                for b in got:
                    await self._apply(b)
                self.stats.replayed += len(got)
            elif self._expected is not None:
                await self._lost(start, batch.seq)
        await self._apply(batch)

    async def catch_up(self) -> None:
        """Apply every batch the publisher buffered beyond the last one applied (needs the
        replay socket); where the buffer no longer reaches back that far, forget the worker's
        cached blocks first."""
        if self.replay_endpoint is None:
            return
        start = 0 if self._expected is None else self._expected
        got = await self._fetch_replay(start, stop=None)
        if not got:
            return
        for b in got:
            if self._expected is not None and b.seq > self._expected:
                self.stats.gaps += 1
                await self._lost(self._expected, b.seq)
            await self._apply(b)
        self.stats.replayed += len(got)

    async def _lost(self, start: int, stop: int) -> None:
        """Batches `start..stop-1` are gone for good: the worker's cached blocks are unknown, so
        the directory forgets them (an `AllBlocksCleared` batch numbered `stop - 1`); nothing
        else of the worker is touched."""
        log.warning(
            "worker %s: KV events %d..%d lost; forgetting its cached blocks",
            self.worker,
            start,
            stop - 1,
        )
        self.stats.resyncs += 1
        await self._sink.apply_events(
            self.worker, EventBatch(stop - 1, self._last_ts, (AllBlocksCleared(),))
        )
        self._expected = stop

    async def _apply(self, batch: EventBatch) -> None:
        result = await self._sink.apply_events(self.worker, batch)
        if result.skipped:
            if not self.stats.skipped_blocks:
                sizes = sorted({e.block_size for e in batch.events if isinstance(e, BlockStored)})
                log.warning(
                    "worker %s: %d stored blocks not mapped (block size in its events: %s); "
                    "the router's models[].block_size must equal the engine's block size",
                    self.worker,
                    result.skipped,
                    sizes,
                )
            self.stats.skipped_blocks += result.skipped
        self._expected = batch.seq + 1
        self._last_ts = max(self._last_ts, batch.ts)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_seq = batch.seq

    async def _fetch_replay(self, start: int, stop: int | None) -> list[EventBatch] | None:
        """Buffered batches with `start <= seq` (and `< stop`), in seq order; None when the
        replay socket is missing or does not answer in time."""
        if self.replay_endpoint is None:
            return None
        got: list[EventBatch] = []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = decode_seq(frames[2])
                if seq == END_SEQ:
                    break
                if seq >= start and (stop is None or seq < stop):
                    got.append(decode_payload(frames[3], seq))
        except KVEventWireError as exc:
            log.warning("worker %s: bad replay message: %s", self.worker, exc)
            return None
        finally:
            dealer.close(linger=0)
        got.sort(key=lambda b: b.seq)
        return got


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: its PUB binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_for_source(
    worker: str, source: Mapping[str, Any], sink: KVEventSink, **kwargs: Any
) -> KVEventSubscriber:
    """A subscriber for one entry of vLLM's `/kv_event_sources` (its resolved KV events config):
    connects where the publisher binds (a wildcard host is reached on loopback), binds where
    the publisher connects."""
    endpoint = str(source["endpoint"])
    binds = publisher_binds(endpoint)
    if binds:
        endpoint = endpoint.replace("*", "127.0.0.1")
    replay = source.get("replay_endpoint")
    return KVEventSubscriber(
        worker,
        endpoint,
        sink,
        replay_endpoint=None if replay is None else str(replay).replace("*", "127.0.0.1"),
        topic=str(source.get("topic") or "").encode(),
        bind=not binds,
        **kwargs,
    )
