"""`ResponseWriter`: where one completion response goes (the router's own HTTP server and the
ASGI adapter each implement it), tracking how far the response got so a failure can end it
properly."""

from __future__ import annotations

from ownerserve.http import sse_error_event


class ResponseWriter:
    """Where one completion response goes. The router's own server (`router.httpserver`)
    writes to the socket; `router.asgi.ASGIResponseWriter` turns the calls into ASGI
    messages. Tracks how far the response got, so a failure can end it properly."""

    __slots__ = ("disconnected", "ended", "request_id", "sse", "started", "stopping")

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.sse = False
        self.disconnected = False
        """Set by the server when the client went away (the request task is cancelled)."""
        self.stopping = False
        """Set by the server when it stops with the request unfinished (the request task is
        cancelled): the response ends with an error (`ShuttingDownError`)."""
        self.request_id = b""
        """The request's id (`router.requestlog.request_id`), set by the runner: its answer
        carries it in `x-request-id`."""

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        """Status and headers; with `body`, the whole response (its length is added)."""
        raise NotImplementedError

    async def write(self, chunk: bytes) -> None:
        """A piece of a streamed body."""
        raise NotImplementedError

    async def end(self) -> None:
        """End a streamed body."""
        raise NotImplementedError

    def detach(self) -> None:
        """Stop watching for the client's disconnect (what follows must not be cancelled)."""

    direct = False
    """True when `write_nowait`/`drain` work: chunks can be written from a callback."""

    def write_nowait(self, chunk: bytes) -> bool:
        """Write a piece of a streamed body now; True if the client is not keeping up (then
        `drain()` before writing more)."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written."""

    async def fail(self, exc: BaseException) -> None:
        """End a response that already started: an SSE error event if it streams events."""
        if self.ended:
            return
        if self.sse:
            await self.write(sse_error_event(exc))
        await self.end()
