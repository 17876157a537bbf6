"""A real ZMQ SUB socket on an emulated engine's KV event endpoint, for the tests that read
what the engine publishes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq
import zmq.asyncio


class ZmqSubscriber:
    """Subscribed to every topic, connected to `endpoint`; `close` ends it without lingering."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def messages(self, quiet_s: float) -> AsyncIterator[list[bytes]]:
        """The multipart messages that arrive until none has for `quiet_s`."""
        while await self.sock.poll(int(quiet_s * 1000)):
            yield await self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
