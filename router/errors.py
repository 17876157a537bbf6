"""The one place that turns exceptions into OpenAI-shaped error responses (status, JSON body)
and SSE error events. Unknown exceptions become a generic 500 that leaks no internals."""

from __future__ import annotations

import logging

import orjson

from ownerserve.errors import OwnerServeError, error_body_for, openai_error_body

log = logging.getLogger(__name__)


class RequestCancelledError(Exception):
    """The client went away; upstream work was cancelled."""


def error_status_and_body(exc: BaseException) -> tuple[int, bytes]:
    """HTTP status and OpenAI error JSON for `exc`."""
    if isinstance(exc, OwnerServeError):
        return exc.status_code, orjson.dumps(error_body_for(exc))
    log.error("unexpected error", exc_info=exc)
    body = openai_error_body("internal error in the router", "internal_error")
    return 500, orjson.dumps(body)


def sse_error_event(exc: BaseException) -> bytes:
    """An SSE event carrying the error, followed by `[DONE]`, to end a stream cleanly."""
    _, body = error_status_and_body(exc)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"
