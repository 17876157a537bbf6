"""The Anthropic Messages API over chat completions: a request becomes a chat request
(`to_chat`), a chat answer becomes a message (`to_message`), a chat stream becomes Anthropic's
event sequence (`MessageStream`), and errors take Anthropic's shape (`error_body`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from ownerserve.errors import InvalidRequestError
from router.frontdoors.chat import (
    ChatAnswer,
    DeltaStream,
    StreamError,
    ToolCall,
    Usage,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# what passes from a Messages request to the chat request unchanged (`top_k`: vLLM's extension)
_SAMPLING = ("temperature", "top_p", "top_k")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(status: int, message: str) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`: Anthropic's error shape."""
    err = {"type": error_type(status), "message": message}
    return orjson.dumps({"type": "error", "error": err})


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message)


# --- request ------------------------------------------------------------------------------------


def _text_of(blocks: Any, where: str) -> str:
    """A string, or the text of a list of text blocks (system prompt, tool result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}.{i}: only text blocks are supported here")
        parts.append(b["text"])
    return "\n".join(parts)


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}.source: required")
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f"{where}.source.type: must be 'base64' or 'url'")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(content: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """A tool result's text, and its images: chat tool messages carry text only, so the images
    go to the user message that follows the tool messages (a screenshot a tool returned)."""
    if not isinstance(content, list):
        return _text_of(content, where), []
    texts = [b for b in content if not (isinstance(b, dict) and b.get("type") == "image")]
    images = [
        _image_part(b, f"{where}.{i}")
        for i, b in enumerate(content)
        if isinstance(b, dict) and b.get("type") == "image"
    ]
    return _text_of(texts, where), images


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """One user turn: its tool results as tool messages first (they answer the previous
    assistant turn's calls), then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}: must be a string or a non-empty list of content blocks")
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image_part(b, at))
        elif kind == "tool_result":
            call_id = b.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{at}.tool_use_id: required")
            result, images = _tool_result(b.get("content", ""), f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": call_id, "content": result})
            parts.extend(images)
        else:
            raise _bad(f"{at}.type: unsupported content block {kind!r} in a user turn")
    out = tools
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        text: Any = "\n".join(p["text"] for p in parts) if only_text else parts
        out.append({"role": "user", "content": text})
    return out


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(f"{at}: a tool_use block needs an 'id' and a 'name'")
            args = orjson.dumps(b.get("input") or {}).decode()
            fn = {"name": b["name"], "arguments": args}
            calls.append({"id": b["id"], "type": "function", "function": fn})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # chat templates drop earlier turns' reasoning too
        else:
            raise _bad(f"{at}.type: unsupported content block {kind!r} in an assistant turn")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools: must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad(f"tools.{i}: must be an object with a 'name'")
        kind = t.get("type")
        if kind not in (None, "custom") or "input_schema" not in t:
            raise _bad(
                f"tools.{i}: only client tools with an input_schema are served here "
                f"(not {kind or t['name']!r})"
            )
        fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """Chat's `tool_choice` and whether parallel calls are allowed."""
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _bad("tool_choice: must be an object with a 'type'")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: required for type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in _TOOL_CHOICES:
        raise _bad(f"tool_choice.type: unknown {kind!r}")
    return _TOOL_CHOICES[kind], parallel


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request that serves a Messages request (400 on bad input)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens: required, an integer >= 1")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty list")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            chat.extend(_user_messages(m.get("content"), f"{where}.content"))
        elif role == "assistant":
            chat.append(_assistant_message(m.get("content"), f"{where}.content"))
        else:
            raise _bad(f"{where}.role: must be 'user' or 'assistant'")
    out: dict[str, Any] = {"model": model, "messages": chat, "max_tokens": max_tokens}
    for key in _SAMPLING:
        if body.get(key) is not None:
            out[key] = body[key]
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop_sequences: must be a list of strings")
        out["stop"] = stop
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if not parallel:
            out["parallel_tool_calls"] = False
    output_config = body.get("output_config")
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is not None:
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise _bad("output_config.format: must be a json_schema format with a 'schema'")
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"]},
        }
    if isinstance(body.get("metadata"), dict):
        # Claude Code's session may be in metadata.user_id: the identify stage reads it
        out["metadata"] = body["metadata"]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def count_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """`to_chat` of a `count_tokens` request (which has no `max_tokens`)."""
    return to_chat({**body, "max_tokens": 1, "stream": False})


# --- answer -------------------------------------------------------------------------------------


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def _input(call: ToolCall) -> Any:
    try:
        value = orjson.loads(call.arguments or "{}")
    except orjson.JSONDecodeError:
        # a model's malformed arguments: Anthropic's `input` must be an object
        return {}
    return value if isinstance(value, dict) else {}


def _usage(u: Usage) -> dict[str, Any]:
    # Anthropic counts cache reads apart from `input_tokens`
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop(answer_finish: str | None, stop_reason: str | int | None) -> tuple[str, str | None]:
    if answer_finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(answer_finish or "stop", "end_turn"), None


def to_message(answer: ChatAnswer, model: str, message_id: str) -> dict[str, Any]:
    """The Messages API answer for a whole chat answer."""
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    for call in answer.tool_calls:
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)}
        content.append(block)
    stop_reason, stop_sequence = _stop(answer.finish_reason, answer.stop_reason)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(answer.usage),
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageStream(DeltaStream):
    """Anthropic's event sequence for one chat stream: `message_start`, per content block
    `content_block_start` / `_delta` / `_stop`, `message_delta` (stop reason, usage),
    `message_stop`; a stream error becomes an `error` event."""

    def __init__(self, model: str, message_id: str) -> None:
        self.model = model
        self.message_id = message_id
        self._open: tuple[str, int] | None = None
        """The content block being written: its kind (text, thinking, tool index) and index."""
        self._blocks = 0
        self.failed = False

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _switch(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        index = self._blocks
        self._blocks += 1
        self._open = (kind, index)
        start = {"type": "content_block_start", "index": index, "content_block": block}
        return out + _event("content_block_start", start)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index = self._open[1]
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        assert self._open is not None
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._open[1], "delta": delta},
        )

    def on_text(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open[0] != "text":
            out = self._switch("text", {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def on_reasoning(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open[0] != "thinking":
            out = self._switch("thinking", {"type": "thinking", "thinking": ""})
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def on_tool_call(self, index: int, call_id: str, name: str) -> bytes:
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return self._switch(f"tool{index}", block)

    def on_tool_args(self, index: int, text: str) -> bytes:
        if self._open is None or self._open[0] != f"tool{index}":
            return b""
        return self._delta({"type": "input_json_delta", "partial_json": text})

    def on_error(self, error: StreamError) -> bytes:
        return self.fail(502, error.message)

    def finish(self, answer: ChatAnswer) -> bytes:
        """`message_delta` and `message_stop` once the chat stream ended."""
        if self.failed:
            return b""
        stop_reason, stop_sequence = _stop(answer.finish_reason, answer.stop_reason)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(answer.usage),
        }
        return (
            self._close()
            + _event("message_delta", delta)
            + _event("message_stop", {"type": "message_stop"})
        )

    def fail(self, status: int, message: str) -> bytes:
        """An `error` event: the stream ends there."""
        if self.failed:
            return b""
        self.failed = True
        return b"event: error\ndata: " + error_body(status, message) + b"\n\n"
