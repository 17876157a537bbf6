"""The router's subscriber to a worker's KV events (vLLM's ZMQ PUB + replay protocol, codec in
`ownerserve.vllm_events`; SGLang publishes the same format): it feeds every batch to the
directory in order, filling gaps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from ownerserve.config import WorkerSettings
from ownerserve.directory.base import EventApplyResult
from ownerserve.events import AllBlocksCleared, BlockStored, EventBatch
from ownerserve.tasks import cancel_and_wait
from ownerserve.vllm_events import (
    END_SEQ,
    KVEventWireError,
    decode_message,
    decode_payload,
    decode_seq,
)

log = logging.getLogger(__name__)


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
    unknown_parent_blocks: int = 0
    """Of `skipped_blocks`: those continuing a chain the directory forgot (expected after the
    worker was dropped or lost events while its engine kept its cache)."""
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
        self._closing = False
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
        self._closing = True  # ends the loop even if a step swallowed the cancel below
        await cancel_and_wait(self._task)
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        # Batches published before the SUB connection was up are lost on PUB/SUB; fetch them.
        await self._guarded(self.catch_up())
        idle_ms = None
        if self.replay_endpoint is not None and self.catch_up_interval_s is not None:
            idle_ms = int(self.catch_up_interval_s * 1000)
        # `_closing`, not only the cancel: a step that swallows a cancel (asyncio.timeout on
        # Python 3.11 may turn one that coincides with its own expiry into a TimeoutError)
        # would otherwise go on polling a socket `close` has closed
        while not self._closing:
            if not await sub.poll(idle_ms):
                # Quiet for a while: a lost *last* batch shows no gap until the next one.
                await self._guarded(self.catch_up())
                continue
            frames = await sub.recv_multipart()
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
        mismatched = result.skipped - result.unknown_parent
        # said once: the first mismatch of this subscriber
        if mismatched and self.stats.skipped_blocks == self.stats.unknown_parent_blocks:
            sizes = sorted({e.block_size for e in batch.events if isinstance(e, BlockStored)})
            log.warning(
                "worker %s: %d stored blocks not mapped (block size in its events: %s); "
                "the router's models[].block_size must equal the engine's block size",
                self.worker,
                mismatched,
                sizes,
            )
        if result.unknown_parent:
            # a worker back from the dead (or past lost events) still caches what the directory
            # forgot, and its new blocks extend those chains: not recorded until it stores
            # their start again. Expected, so said once and quietly.
            if not self.stats.unknown_parent_blocks:
                log.info(
                    "worker %s: %d stored blocks continue chains the directory forgot (from "
                    "before the worker was dropped or lost events); not recorded",
                    self.worker,
                    result.unknown_parent,
                )
            self.stats.unknown_parent_blocks += result.unknown_parent
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


def subscriber_for(
    settings: WorkerSettings, sink: KVEventSink, *, bind: bool
) -> KVEventSubscriber | None:
    """A subscriber to the KV events a worker's settings name (`kv_events_endpoint`, with its
    replay socket), or None when they name none; `bind` when the publisher connects to it."""
    endpoint = settings.kv_events_endpoint
    if not endpoint:
        return None
    replay = settings.kv_events_replay_endpoint
    return KVEventSubscriber(settings.id, endpoint, sink, bind=bind, replay_endpoint=replay)
