"""HTTP plumbing shared by the router and the workers: reading a request body within a size
limit, JSON responses, and the one mapping from exceptions to the OpenAI error shape (as a
status and body, as an SSE event, and as exception handlers for a FastAPI app)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ownerserve.errors import (
    ClientDisconnected,
    HTTPStatusError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OwnerServeError,
    PayloadTooLargeError,
    error_body_for,
    openai_error_body,
)

log = logging.getLogger(__name__)

# The narrowest ASGI types, so that every server's and app's own spelling of them fits.
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = b"application/json"
INTERNAL_ERROR_MESSAGE = "internal server error"
"""What a client is told of an unexpected exception: no internals (the log has them)."""
DRAIN_BYTES = 256 * 1024 * 1024
"""Of a request refused for its size, read and drop at most this much more of its body..."""
DRAIN_S = 10.0
"""... and for at most this long (nginx lingers up to 30 s). A client that writes its whole
body before it reads (`http.client`, so `urllib` and `requests`) sees a reset instead of the
answer when the server closes with its body unread."""


# --- errors ------------------------------------------------------------------------------------


def error_status_and_body(exc: BaseException) -> tuple[int, bytes]:
    """HTTP status and OpenAI error JSON for `exc`: the one place exceptions become error
    bodies. An exception not ours is logged and becomes a generic 500."""
    if isinstance(exc, OwnerServeError):
        return exc.status_code, orjson.dumps(error_body_for(exc))
    log.error("unexpected error", exc_info=exc)
    return 500, orjson.dumps(openai_error_body(INTERNAL_ERROR_MESSAGE, "internal_error"))


_INTERNALS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://"  # a URL
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"  # an IPv4 address
    r"|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\]"  # a bracketed IPv6 address
    r"|[\w.-]+:\d{2,5}\b"  # host:port
    r"|localhost"
    r"|kv_transfer_params|bootstrap|engine|remote_|sidecar",  # the KV hand-over's internals
    re.IGNORECASE,
)
WORKER_ERROR_MESSAGE = "the worker could not serve the request"
"""What a client is told of a worker's error whose message names internals (`names_internals`);
the router's log has the worker's own words."""


def names_internals(message: str) -> bool:
    """Whether an error message names what a client must not learn: a URL, an IP address or a
    host:port, or the KV hand-over between engines (its params, rooms and engine ids)."""
    return _INTERNALS.search(message) is not None


def _short_str(value: object) -> str | None:
    """A worker's error `type`, `code` or `param` fit to pass on: a short plain string."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return text if len(text) <= 64 and not names_internals(text) else None


def public_error_body(status: int, body: bytes) -> tuple[bytes, str | None]:
    """A worker's error answer (`status`, `body`) as the client gets it: the OpenAI error shape
    with the worker's message, type, code and param, but never its raw body, and a generic
    message (`WORKER_ERROR_MESSAGE`) when its message names internals (`names_internals`) or it
    has none. Returns (the body, the worker's words withheld or None) so the caller can log
    them."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    # OpenAI's `{"error": {...}}`, vLLM's older flat `{"object": "error", ...}`, FastAPI's detail
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        err = data if isinstance(data, dict) and data.get("object") == "error" else {}
    message = err.get("message") if err else None
    if message is None and isinstance(data, dict) and isinstance(data.get("detail"), str):
        message = data["detail"]
    withheld: str | None = None
    if not isinstance(message, str) or not message or names_internals(message):
        withheld = body[:500].decode(errors="replace")
        message = WORKER_ERROR_MESSAGE
    default_type = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
    out = openai_error_body(
        message,
        _short_str(err.get("type")) or default_type,
        _short_str(err.get("code")),
        _short_str(err.get("param")),
    )
    return orjson.dumps(out), withheld


def sse_error_event(exc: BaseException) -> bytes:
    """An SSE event carrying the error, followed by `[DONE]`, to end a stream cleanly."""
    _, body = error_status_and_body(exc)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


def _error_response(exc: BaseException) -> Response:
    """`exc` as a Starlette response."""
    status, body = error_status_and_body(exc)
    return Response(body, status_code=status, media_type="application/json")


def _framework_error(status_code: int, detail: str) -> OwnerServeError:
    """Our exception for an HTTP error the web framework raised (no route, wrong method)."""
    if status_code == 404:
        return NotFoundError("no such endpoint")
    if status_code == 405:
        return MethodNotAllowedError("method not allowed")
    return HTTPStatusError(detail, status_code)


def _validation_error(errors: list[Any]) -> InvalidRequestError:
    """Our exception for a request FastAPI's validation refused (the first error named)."""
    if not errors:
        return InvalidRequestError("invalid request: body: invalid body")
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    return InvalidRequestError(f"invalid request: {where}: {first['msg']}")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error `app` answers, ours or the framework's, the OpenAI error shape."""

    async def mapped(_: Request, exc: Exception) -> Response:
        return _error_response(exc)

    async def validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error_response(_validation_error(list(exc.errors())))

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error_response(_framework_error(exc.status_code, str(exc.detail)))

    app.add_exception_handler(OwnerServeError, mapped)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, mapped)


def service_app(
    title: str, start: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]
) -> FastAPI:
    """A FastAPI app whose lifespan runs `start` and `close`, with no docs routes and every
    error in the OpenAI shape (`install_error_handlers`): the router's, the sidecar's."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await start()
        try:
            yield
        finally:
            await close()

    # no redirect of a path with or without its trailing slash: Starlette builds its
    # `Location` from the client's Host header (a redirect anywhere); such a path is a 404
    app = FastAPI(
        title=title,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    install_error_handlers(app)
    return app


# --- requests ----------------------------------------------------------------------------------


MAX_JSON_DEPTH = 200
"""How deep a request body may nest (`json_object`). orjson writes no value nested deeper than
254 levels (`orjson.dumps` raises "Recursion limit reached"), and a body is written again after
it is read, some parts a few levels deeper (without its control-plane fields, a message as a
cache key, a front door's request as a chat request and as a stored conversation): a body
nested past this is a 400 when it is read, not a 500 later."""
_ORJSON_MAX_DEPTH = 254


def _too_deep(raw: bytes, data: object) -> bool:
    """Whether `data` (parsed from `raw`) nests deeper than `MAX_JSON_DEPTH`: never when `raw`
    has fewer brackets than that (one pass in C), else whether orjson can still write it with
    the difference added on top."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    for _ in range(_ORJSON_MAX_DEPTH - MAX_JSON_DEPTH):
        data = [data]
    try:
        orjson.dumps(data)
    except orjson.JSONEncodeError:
        return True
    return False


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object, nested at most `MAX_JSON_DEPTH` deep;
    `InvalidRequestError` (400) otherwise."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if _too_deep(raw, data):
        raise InvalidRequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of header `name` (lower case) in ASGI `headers`, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


async def read_body(
    receive: Receive,
    limit: int,
    content_length: str | bytes | None,
    *,
    expects_continue: bool = False,
    drain_bytes: int = DRAIN_BYTES,
    drain_s: float = DRAIN_S,
) -> bytes:
    """The ASGI request body, refusing more than `limit` bytes (`PayloadTooLargeError`, 413):
    up front when `content_length` declares more, else while reading. A refused body is
    drained first (read and dropped, within `drain_bytes` and `drain_s`): an ASGI app cannot
    read once it has answered, and the server may close right after the answer. Not when the
    client waits for `100 Continue` (`expects_continue`): it sends no body once refused.
    Raises `ClientDisconnected` when the client goes away first."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise InvalidRequestError("bad content-length header") from None
        if declared > limit:
            if not expects_continue:
                await drain_body(receive, drain_bytes, drain_s)
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("the client went away while sending its request")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if chunk:
            size += len(chunk)
            if size > limit:
                if more:
                    await drain_body(receive, drain_bytes, drain_s)
                raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not more:
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_request_body(scope: MutableMapping[str, Any], receive: Receive, limit: int) -> bytes:
    """`read_body` of an ASGI request, with its `content-length` and `expect` headers."""
    headers = scope["headers"]
    expect = _header(headers, b"expect")
    return await read_body(
        receive,
        limit,
        _header(headers, b"content-length"),
        expects_continue=expect is not None and expect.lower() == b"100-continue",
    )


async def drain_body(receive: Receive, max_bytes: int, max_s: float) -> None:
    """Read and drop the rest of an ASGI request body: until it ends or the client goes away,
    or for at most `max_bytes` or `max_s`, whichever comes first."""
    left = max_bytes
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max_s):
            while left >= 0:
                message = await receive()
                if message["type"] != "http.request":
                    return
                left -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


# --- responses ---------------------------------------------------------------------------------


async def send_body(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    """A whole ASGI response with a known length."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any) -> None:
    """`obj` as a JSON ASGI response."""
    await send_body(send, status, orjson.dumps(obj), _JSON)


async def send_error(send: Send, exc: BaseException) -> None:
    """`exc` as an OpenAI-shaped ASGI error response."""
    status, body = error_status_and_body(exc)
    await send_body(send, status, body, _JSON)
