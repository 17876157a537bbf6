"""Publishes an emulated engine's KV events over ZMQ exactly as vLLM does.

A PUB socket bound to `tcp://HOST:PORT` sends one multipart message `[topic, seq, payload]` per
engine step that changed the cache (codec: `ownerserve.vllm_events`); seq counts from 0.
With a replay port, a ROUTER socket answers vLLM-style replay requests from a buffer of recent
batches, so a subscriber that missed messages can catch up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from ownerserve.events import EventBatch, KVEvent
from ownerserve.tasks import cancel_and_wait
from ownerserve.vllm_events import encode_message

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """vLLM-compatible KV event publisher (PUB, plus an optional replay ROUTER)."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._buffer: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint is not None:
            self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Send one batch now; returns its seq. Never blocks (PUB drops past its HWM)."""
        seq = self._seq
        self._seq += 1
        batch = EventBatch(seq=seq, ts=time.time(), events=tuple(events))
        frames = encode_message(batch, self._topic)
        self._buffer.append((seq, frames))
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("KV event batch %d dropped: publisher queue full", seq)
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request with %d frames", len(frames))
                continue
            client, _empty, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, batch in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart([client, b"", *batch])
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        await cancel_and_wait(self._replay_task)
        self._replay_task = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        self._pub.close(linger=0)
        self._ctx.term()
