"""The front doors' HTTP glue: `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI) served
by translating each request to a chat completion, running it through the router's request
pipeline (`router.pipeline.respond`: every plan action and backend kind applies) and
translating what the pipeline writes (`DoorWriter`) back into the route's own shapes."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from ownerserve.errors import (
    DirectoryUnavailableError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OwnerServeError,
    openai_error_body,
)
from ownerserve.http import error_status_and_body, json_object, read_request_body
from router.asgi import ASGIResponseWriter, Receive, Scope, Send, watch_disconnect
from router.frontdoors import messages, responses
from router.frontdoors.chat import ChatStreamReader, StreamError, answer_of, error_of
from router.frontdoors.responses import Conversation, ResponsesRequest
from router.frontdoors.store import ConversationStore, open_store
from router.pipeline import respond
from router.requestlog import REQUEST_ID_HEADER, RequestLog, request_id
from router.requests import Endpoint
from router.session import SESSION_HEADERS, identify_session
from router.streaming import PLAN_HEADER
from router.writer import ResponseWriter

if TYPE_CHECKING:
    from router.state import Router

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_KEPT_HEADERS = (PLAN_HEADER, REQUEST_ID_HEADER, b"retry-after")
"""What the pipeline's response headers keep on a front door (the content type is the route's)."""
_RESPONSE_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.:-]{1,200})(/cancel)?$")


class Translation(Protocol):
    """How one route turns what the chat pipeline writes into its own answer."""

    async def whole(self, status: int, body: bytes) -> bytes:
        """A whole answer (or error) of `status`, in the route's shape."""
        ...

    def opening(self) -> bytes:
        """The first events of a streamed answer."""
        ...

    def chunk(self, chunk: bytes) -> bytes:
        """Events for a piece of the chat stream."""
        ...

    async def closing(self) -> bytes:
        """The last events, once the chat stream ended."""
        ...

    def failure(self, exc: BaseException) -> bytes:
        """The error event that ends a stream the router gave up mid-way."""
        ...


class DoorWriter(ResponseWriter):
    """A `ResponseWriter` for the pipeline that writes the route's translation of each call
    to the client's writer."""

    __slots__ = ("inner", "translation")

    def __init__(self, inner: ResponseWriter, translation: Translation) -> None:
        super().__init__()
        self.inner = inner
        self.translation = translation

    async def start(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> None:
        kept = [(k, v) for k, v in headers if k in _KEPT_HEADERS]
        if body is not None:
            # translated first: if that fails, the pipeline answers its error through `start`
            payload = await self.translation.whole(status, body)
            self.started = self.ended = True
            self.detach()  # servers report a disconnect once the answer is complete
            await self.inner.start(status, _JSON + kept, payload)
            return
        self.started = True
        await self.inner.start(status, _SSE + kept)
        await self.inner.write(self.translation.opening())

    async def write(self, chunk: bytes) -> None:
        out = self.translation.chunk(chunk)
        if out:
            await self.inner.write(out)

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        tail = await self.translation.closing()
        self.detach()  # servers report a disconnect once the answer is complete
        if tail:
            await self.inner.write(tail)
        await self.inner.end()

    async def fail(self, exc: BaseException) -> None:
        if self.ended:
            return
        await self.inner.write(self.translation.failure(exc))
        self.ended = True
        await self.inner.end()

    def detach(self) -> None:
        self.inner.detach()


def _upstream_error(status: int, body: bytes) -> StreamError:
    """The error an error answer carries (the router's, or a worker's in any OpenAI-like
    shape)."""
    try:
        err = error_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        err = None
    return err or StreamError(f"upstream answered {status}", "upstream_error", None)


class MessagesTranslation:
    """Chat answers as Anthropic messages."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.message_id = messages.new_message_id()
        self.reader = ChatStreamReader()
        self.stream = messages.MessageStream(model, self.message_id)

    async def whole(self, status: int, body: bytes) -> bytes:
        if status != 200:
            return messages.error_body(status, _upstream_error(status, body).message)
        answer = answer_of(orjson.loads(body))
        return orjson.dumps(messages.to_message(answer, self.model, self.message_id))

    def opening(self) -> bytes:
        return self.stream.start()

    def chunk(self, chunk: bytes) -> bytes:
        return self.stream.feed(self.reader.feed(chunk))

    async def closing(self) -> bytes:
        if not self.reader.done and not self.stream.failed:
            return self.stream.fail(502, "the worker's stream ended early")
        return self.stream.finish(self.reader.answer())

    def failure(self, exc: BaseException) -> bytes:
        status, body = error_status_and_body(exc)
        return self.stream.fail(status, _upstream_error(status, body).message)


class ResponsesTranslation:
    """Chat answers as Responses, stored (with the conversation so far) when `store`."""

    def __init__(
        self,
        req: ResponsesRequest,
        conversation_id: str | None,
        history: tuple[dict[str, Any], ...],
        store: ConversationStore,
    ) -> None:
        self.req = req
        self.response_id = responses.new_id("resp")
        self.conversation_id = conversation_id or self.response_id
        self.history = history
        self.store = store
        self.created_at = responses.now()
        self.reader = ChatStreamReader()
        self.stream = responses.ResponseStream(req, self.response_id, self.created_at)

    async def _keep(self, answer_msg: dict[str, Any], response: dict[str, Any]) -> None:
        if not self.req.store or response["status"] == "failed":
            return
        conv = Conversation(
            self.conversation_id, (*self.history, *self.req.input, answer_msg), response
        )
        try:
            await self.store.put(self.response_id, conv)
        except Exception as exc:  # the answer stands; only its continuation is lost
            log.warning("storing response %s failed: %r", self.response_id, exc)

    async def whole(self, status: int, body: bytes) -> bytes:
        if status != 200:
            err = _upstream_error(status, body)
            return orjson.dumps(openai_error_body(err.message, err.type, err.code))
        answer = answer_of(orjson.loads(body))
        response = responses.to_response(self.req, answer, self.response_id, self.created_at)
        await self._keep(responses.assistant_message(answer), response)
        return orjson.dumps(response)

    def opening(self) -> bytes:
        return self.stream.start()

    def chunk(self, chunk: bytes) -> bytes:
        return self.stream.feed(self.reader.feed(chunk))

    async def closing(self) -> bytes:
        if self.stream.failed:
            return b""
        if not self.reader.done:
            return self.stream.fail("the worker's stream ended early", "upstream_error")
        answer = self.reader.answer()
        out, response = self.stream.finish(answer)
        await self._keep(responses.assistant_message(answer), response)
        return out

    def failure(self, exc: BaseException) -> bytes:
        status, body = error_status_and_body(exc)
        code = exc.code or exc.error_type if isinstance(exc, OwnerServeError) else "server_error"
        return self.stream.fail(_upstream_error(status, body).message, code)


Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
Prepare = Callable[[Any, list[tuple[bytes, bytes]]], Awaitable[tuple[dict[str, Any], Translation]]]
"""A translating route's request body (and the client's headers) as a chat request, and the
translation of its answer (`FrontDoors._translating`)."""


class FrontDoors:
    """The `/v1/messages` and `/v1/responses` routes of one router, and the Responses store
    (opened beside the directory: `open_store`)."""

    def __init__(self, router: Router, store: ConversationStore | None = None) -> None:
        self.router = router
        self.store = store if store is not None else open_store(router.settings)
        self.messages = self._translating(self._messages_chat, messages_shape=True)
        """`POST /v1/messages`."""
        self.create_response = self._translating(self._responses_chat, messages_shape=False)
        """`POST /v1/responses`."""

    async def close(self) -> None:
        await self.store.close()

    def handler(self, method: str, path: str) -> Handler | None:
        """The handler of a front-door request, None for any other path."""
        if path == "/v1/messages":
            return self.messages if method == "POST" else self._not_allowed(messages_shape=True)
        if path == "/v1/messages/count_tokens":
            return self.count_tokens if method == "POST" else self._not_allowed(True)
        if path == "/v1/responses":
            return self.create_response if method == "POST" else self._not_allowed(False)
        m = _RESPONSE_PATH.match(path)
        if m is None:
            return None
        if m.group(2):
            return self.cancel_response if method == "POST" else self._not_allowed(False)
        if method == "GET":
            return self.get_response
        if method == "DELETE":
            return self.delete_response
        return self._not_allowed(False)

    def _not_allowed(self, messages_shape: bool) -> Handler:
        async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
            exc = MethodNotAllowedError(f"method {scope['method']} not allowed on {scope['path']}")
            await _send_error(ASGIResponseWriter(send), exc, messages_shape)

        return refuse

    # --- helpers ---------------------------------------------------------------------------

    def _headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The client's headers; Anthropic's `x-api-key` becomes the bearer token the router
        checks (and is not forwarded to workers)."""
        raw: list[tuple[bytes, bytes]] = list(scope["headers"])
        key = next((v for k, v in raw if k == b"x-api-key"), None)
        raw = [(k, v) for k, v in raw if k != b"x-api-key"]
        if key is not None and not any(k == b"authorization" for k, _ in raw):
            raw.append((b"authorization", b"Bearer " + key))
        return raw

    async def _read(self, scope: Scope, receive: Receive, raw: list[tuple[bytes, bytes]]) -> Any:
        self.router.check_auth({k.decode("latin-1"): v.decode("latin-1") for k, v in raw})
        body = await read_request_body(scope, receive, self.router.settings.server.max_body_bytes)
        return json_object(body)

    def _translating(self, prepare: Prepare, messages_shape: bool) -> Handler:
        """The handler of a translating route: `prepare` makes the request's body a chat
        request (and says how to translate its answer), which runs through the router's
        pipeline. An error before that is answered in the route's error shape
        (`messages_shape`: Anthropic's)."""

        async def translate(scope: Scope, receive: Receive, send: Send) -> None:
            t0 = time.perf_counter()
            out = ASGIResponseWriter(send)
            raw = self._headers(scope)
            try:
                chat, translation = await prepare(await self._read(scope, receive, raw), raw)
            except OwnerServeError as exc:
                # refused before the pipeline, which counts and logs every other outcome
                given = next((v for k, v in raw if k == REQUEST_ID_HEADER), None)
                record = RequestLog(request_id(None if given is None else given.decode("latin-1")))
                out.request_id = record.rid.encode()
                status = await _send_error(out, exc, messages_shape)
                metrics = self.router.metrics
                metrics.of(metrics.requests, "?", str(status)).inc()
                record.failed(status, exc, False)
                record.emit(time.perf_counter() - t0)
                return
            writer = DoorWriter(out, translation)
            out.watcher = asyncio.create_task(
                watch_disconnect(receive, asyncio.current_task(), writer)
            )
            try:
                await respond(self.router, Endpoint.CHAT, raw, writer, t0, body=orjson.dumps(chat))
            finally:
                out.detach()

        return translate

    # --- Anthropic Messages ----------------------------------------------------------------

    async def _messages_chat(
        self, body: Any, raw: list[tuple[bytes, bytes]]
    ) -> tuple[dict[str, Any], Translation]:
        chat = messages.to_chat(body)
        return chat, MessagesTranslation(chat["model"])

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = ASGIResponseWriter(send)
        try:
            chat = messages.count_request(await self._read(scope, receive, self._headers(scope)))
            mt = self.router.tokenizers.get(chat["model"])
            if mt is None:
                raise NotFoundError(f"model: {chat['model']!r} is not served here")
            tok = mt.tokenize_chat(None, chat["messages"], chat.get("tools"))
        except OwnerServeError as exc:
            await _send_error(out, exc, True)
            return
        await out.start(200, _JSON, orjson.dumps({"input_tokens": tok.prompt_tokens}))

    # --- OpenAI Responses ------------------------------------------------------------------

    async def _stored(self, response_id: str) -> Conversation | None:
        try:
            return await self.store.get(response_id)
        except Exception as exc:
            log.warning("reading stored response %s failed: %r", response_id, exc)
            raise DirectoryUnavailableError("the response store is unavailable") from None

    async def _responses_chat(
        self, body: Any, raw: list[tuple[bytes, bytes]]
    ) -> tuple[dict[str, Any], Translation]:
        req = responses.parse(body)
        conversation_id: str | None = None
        history: tuple[dict[str, Any], ...] = ()
        if req.previous_response_id is not None:
            prev = await self._stored(req.previous_response_id)
            if prev is None:
                missing = NotFoundError(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id",
                )
                missing.code = "previous_response_not_found"
                raise missing
            conversation_id, history = prev.conversation_id, prev.messages
        chat = responses.chat_request(req, history)
        limit = self.router.settings.responses.max_conversation_bytes
        if req.store and len(orjson.dumps(chat["messages"])) > limit:
            too_large = InvalidRequestError(
                f"the conversation exceeds {limit} bytes (responses.max_conversation_bytes)",
                param="previous_response_id",
            )
            too_large.code = "conversation_too_large"
            raise too_large
        if conversation_id is None:
            # a new conversation's session is what the chat route would find for it (also
            # for a client that resends the whole conversation instead of chaining it)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
            key = identify_session(
                headers, chat, req.model, chat["messages"], derived=self.router.derived_sessions
            )
            conversation_id = key.session_id
        elif not any(k.decode("latin-1") in SESSION_HEADERS for k, _ in raw):
            # the chain keeps its session: its KV stays with its owner, turn after turn
            raw.append((b"x-session-id", conversation_id.encode()))
        return chat, ResponsesTranslation(req, conversation_id, history, self.store)

    async def get_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = ASGIResponseWriter(send)
        try:
            conv = await self._lookup(scope)
        except OwnerServeError as exc:
            await _send_error(out, exc, False)
            return
        await out.start(200, _JSON, orjson.dumps(conv.response))

    async def delete_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = ASGIResponseWriter(send)
        try:
            response_id = self._checked_id(scope)
            try:
                deleted = await self.store.delete(response_id)
            except Exception as exc:
                log.warning("deleting response %s failed: %r", response_id, exc)
                raise DirectoryUnavailableError("the response store is unavailable") from None
            if not deleted:
                raise NotFoundError(f"Response with id '{response_id}' not found.")
        except OwnerServeError as exc:
            await _send_error(out, exc, False)
            return
        body = {"id": response_id, "object": "response.deleted", "deleted": True}
        await out.start(200, _JSON, orjson.dumps(body))

    async def cancel_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = ASGIResponseWriter(send)
        try:
            await self._lookup(scope)
            raise InvalidRequestError("Only background responses can be cancelled.")
        except OwnerServeError as exc:
            await _send_error(out, exc, False)

    def _checked_id(self, scope: Scope) -> str:
        self.router.check_auth(
            {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        )
        m = _RESPONSE_PATH.match(scope["path"])
        assert m is not None  # `handler` matched it
        return m.group(1)

    async def _lookup(self, scope: Scope) -> Conversation:
        response_id = self._checked_id(scope)
        conv = await self._stored(response_id)
        if conv is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.")
        return conv


async def _send_error(out: ResponseWriter, exc: OwnerServeError, messages_shape: bool) -> int:
    """`exc` as a whole answer (with its request id, when `out` has one): Anthropic's shape on
    `/v1/messages`, else OpenAI's; returns its status."""
    status, body = error_status_and_body(exc)
    if messages_shape:
        body = messages.error_body(status, str(exc))
    headers = _JSON if not out.request_id else [*_JSON, (REQUEST_ID_HEADER, out.request_id)]
    await out.start(status, headers, body)
    return status
