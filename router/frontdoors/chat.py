"""What the front doors read back from the workers' chat completions: a whole answer
(`answer_of`), or a stream of chunks decoded into typed deltas (`ChatStreamReader`) that a
front door's `DeltaStream` turns into its own events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of the assistant: its id, the function, its JSON arguments."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the worker found in its prefix cache."""


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """The first choice of a chat completion, as the front doors translate it."""

    id: str
    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    """vLLM's `stop_reason`: the stop string (or token id) that ended the answer."""
    usage: Usage


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class StreamError:
    """An error event in the stream (from the worker, or the router's mid-stream failure)."""

    message: str
    type: str
    code: str | None


Delta = TextDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta | StreamError


class DeltaStream:
    """A front door's event sequence for one chat stream: `feed` hands each delta to the
    method for its kind, in order, until the stream has failed (`failed`)."""

    failed: bool

    def feed(self, deltas: list[Delta]) -> bytes:
        out = b""
        for d in deltas:
            if self.failed:
                break
            if isinstance(d, TextDelta):
                out += self.on_text(d.text)
            elif isinstance(d, ReasoningDelta):
                out += self.on_reasoning(d.text)
            elif isinstance(d, ToolCallStart):
                out += self.on_tool_call(d.index, d.id, d.name)
            elif isinstance(d, ToolArgsDelta):
                out += self.on_tool_args(d.index, d.text)
            else:
                out += self.on_error(d)
        return out

    def on_text(self, text: str) -> bytes:
        """A piece of the answer's text."""
        raise NotImplementedError

    def on_reasoning(self, text: str) -> bytes:
        """A piece of the answer's reasoning."""
        raise NotImplementedError

    def on_tool_call(self, index: int, call_id: str, name: str) -> bytes:
        """Tool call `index` starts."""
        raise NotImplementedError

    def on_tool_args(self, index: int, text: str) -> bytes:
        """A piece of tool call `index`'s JSON arguments."""
        raise NotImplementedError

    def on_error(self, error: StreamError) -> bytes:
        """The stream failed: the events that end it."""
        raise NotImplementedError


def usage_of(raw: Any) -> Usage:
    """`usage` of a chat completion (zeros when absent)."""
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        int(raw.get("prompt_tokens") or 0),
        int(raw.get("completion_tokens") or 0),
        int(cached or 0),
    )


def error_of(body: Any) -> StreamError | None:
    """The error an OpenAI-style error body carries (`{"error": {...}}`, or vLLM's flat
    `{"object": "error", ...}`); None for anything else."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):
        return StreamError(
            str(err.get("message") or "error"),
            str(err.get("type") or "api_error"),
            None if err.get("code") is None else str(err.get("code")),
        )
    if body.get("object") == "error":
        code = body.get("code")
        return StreamError(
            str(body.get("message") or "error"),
            str(body.get("type") or "api_error"),
            None if code is None else str(code),
        )
    return None


def _tool_calls(raw: Any) -> tuple[ToolCall, ...]:
    calls = []
    for c in raw or ():
        if not isinstance(c, dict):
            continue
        fn = c.get("function") or {}
        calls.append(
            ToolCall(str(c.get("id") or ""), str(fn.get("name") or ""), fn.get("arguments") or "")
        )
    return tuple(calls)


def answer_of(body: dict[str, Any]) -> ChatAnswer:
    """The first choice of a whole chat completion."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    return ChatAnswer(
        id=str(body.get("id") or ""),
        text=message.get("content") or "",
        reasoning=reasoning,
        tool_calls=_tool_calls(message.get("tool_calls")),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=usage_of(body.get("usage")),
    )


class SSEDecoder:
    """Server-sent events split from a byte stream: the `data:` payload of each event."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        out = []
        for event in events:
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line[:5] == b"data:"]
            if data:
                out.append(b"\n".join(data))
        return out


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ChatStreamReader:
    """Chat completion chunks in, typed deltas out (choice 0); what it read adds up to the
    whole answer (`answer`)."""

    def __init__(self) -> None:
        self._sse = SSEDecoder()
        self.id = ""
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _Call] = {}
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.usage = Usage()
        self.done = False
        """The stream's `[DONE]` arrived."""
        self.error: StreamError | None = None

    def feed(self, chunk: bytes) -> list[Delta]:
        out: list[Delta] = []
        for data in self._sse.feed(chunk):
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue  # not ours to judge: a worker's comment or keep-alive
            err = error_of(event)
            if err is not None:
                self.error = err
                out.append(err)
                continue
            self._chunk(event, out)
        return out

    def _chunk(self, event: dict[str, Any], out: list[Delta]) -> None:
        self.id = self.id or str(event.get("id") or "")
        if event.get("usage"):
            self.usage = usage_of(event["usage"])
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self.reasoning.append(reasoning)
                out.append(ReasoningDelta(reasoning))
            if delta.get("content"):
                self.text.append(delta["content"])
                out.append(TextDelta(delta["content"]))
            for tc in delta.get("tool_calls") or ():
                self._tool_delta(tc, out)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def _tool_delta(self, tc: dict[str, Any], out: list[Delta]) -> None:
        index = int(tc.get("index") or 0)
        fn = tc.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = _Call(str(tc.get("id") or ""), str(fn.get("name") or ""))
            out.append(ToolCallStart(index, call.id, call.name))
        args = fn.get("arguments")
        if args:
            call.arguments.append(args)
            out.append(ToolArgsDelta(index, args))

    def answer(self) -> ChatAnswer:
        calls = tuple(
            ToolCall(c.id, c.name, "".join(c.arguments)) for _, c in sorted(self.calls.items())
        )
        return ChatAnswer(
            self.id,
            "".join(self.text),
            "".join(self.reasoning),
            calls,
            self.finish_reason,
            self.stop_reason,
            self.usage,
        )
