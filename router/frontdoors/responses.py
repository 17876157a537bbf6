"""The OpenAI Responses API over chat completions: a request's input items become chat messages
(`parse` → `chat_request`), a chat answer becomes a response with output items (`to_response`),
and a chat stream becomes the Responses event sequence (`ResponseStream`). What a stored
response keeps for the next turn is `Conversation` (`router.frontdoors.store` keeps it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ownerserve.errors import InvalidRequestError
from router.frontdoors.chat import (
    ChatAnswer,
    DeltaStream,
    StreamError,
    Usage,
)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""Input roles as chat roles: `developer` is `system` to the chat templates workers run."""
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_CHOICES = ("auto", "none", "required")
# what passes from a Responses request to the chat request unchanged
_PASSED = ("temperature", "top_p", "user", "prompt_cache_key", "parallel_tool_calls", "seed")


def _bad(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses request: what the chat request, the response object and the
    store need."""

    body: dict[str, Any]
    model: str
    input: tuple[dict[str, Any], ...]
    """This turn's input as chat messages."""
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    max_output_tokens: int | None
    chat_tools: tuple[dict[str, Any], ...]
    chat_tool_choice: Any
    response_format: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a stored response keeps: the conversation it belongs to (its first response's id,
    the ownership session) and every chat message up to and including its output."""

    conversation_id: str
    messages: tuple[dict[str, Any], ...]
    response: dict[str, Any]
    """The response object, as `GET /v1/responses/{id}` returns it."""

    def to_bytes(self) -> bytes:
        return orjson.dumps({"c": self.conversation_id, "m": self.messages, "r": self.response})

    @staticmethod
    def from_bytes(raw: bytes) -> Conversation:
        data = orjson.loads(raw)
        return Conversation(data["c"], tuple(data["m"]), data["r"])


# --- request ------------------------------------------------------------------------------------


def _content(content: Any, where: str) -> Any:
    """A message's content as chat content: a string, or parts (text and images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content parts", "input")
    parts: list[dict[str, Any]] = []
    for i, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in _TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            raise _bad(f"{where}.{i}: unsupported content part {kind!r}", "input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    content = _content(output, where)
    if not isinstance(content, str):
        raise _bad(f"{where}: a function call output takes text only", "input")
    return content


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, function calls (the assistant's, merged into
    one assistant message) and their outputs (tool messages); reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("input: must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"{where}: must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise _bad(f"{where}.role: must be user, assistant, system or developer", "input")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            args = item.get("arguments", "")
            if (
                not isinstance(call_id, str)
                or not isinstance(name, str)
                or not isinstance(args, str)
            ):
                raise _bad(f"{where}: a function_call needs call_id, name and arguments", "input")
            fn = {"name": name, "arguments": args}
            call = {"id": call_id, "type": "function", "function": fn}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id: required", "input")
            text = _output_text(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # chat templates drop earlier turns' reasoning too
        else:
            raise _bad(f"{where}.type: unsupported input item {kind!r}", "input")
    return out


def _tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list):
        raise _bad("tools: must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise _bad(
                f"tools.{i}: tool type {kind!r} is not served by this router (function tools are)",
                "tools",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools.{i}.name: required", "tools")
        fn: dict[str, Any] = {"name": t["name"]}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: required", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice: must be auto, none, required or a function", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format.type: unknown {kind!r}", "text")


def parse(body: Mapping[str, Any]) -> ResponsesRequest:
    """Validate a Responses request (400 on bad input)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: required", "model")
    if "input" not in body:
        raise _bad("input: required", "input")
    if body.get("background"):
        raise _bad("background responses are not supported", "background")
    if body.get("conversation") is not None:
        raise _bad("conversation: not supported; use previous_response_id", "conversation")
    stream = body.get("stream") or False
    store = body.get("store", True)
    if not isinstance(stream, bool) or not isinstance(store, bool | None):
        raise _bad("stream and store must be booleans", "stream")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise _bad("previous_response_id: must be a string", "previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions: must be a string", "instructions")
    max_out = body.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int)
                                or max_out < 1):  # fmt: skip
        raise _bad("max_output_tokens: must be an integer >= 1", "max_output_tokens")
    return ResponsesRequest(
        body=dict(body),
        model=model,
        input=tuple(input_messages(body["input"])),
        stream=stream,
        store=store is not False,
        previous_response_id=prev,
        instructions=instructions,
        max_output_tokens=max_out,
        chat_tools=_tools(body["tools"]) if body.get("tools") else (),
        chat_tool_choice=_tool_choice(body.get("tool_choice")),
        response_format=_response_format(body.get("text")),
    )


def chat_request(req: ResponsesRequest, history: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The chat completion request that serves `req` after the stored `history`. The
    instructions apply to this turn only (as the Responses API defines them)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(history)
    messages.extend(req.input)
    if not messages:
        raise _bad("input: empty", "input")
    out: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        out["max_tokens"] = req.max_output_tokens
    for key in _PASSED:
        if req.body.get(key) is not None:
            out[key] = req.body[key]
    if req.chat_tools:
        out["tools"] = list(req.chat_tools)
    if req.chat_tool_choice is not None:
        out["tool_choice"] = req.chat_tool_choice
    if req.response_format is not None:
        out["response_format"] = req.response_format
    reasoning = req.body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]  # vLLM's and OpenAI's chat field
    if req.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


# --- answer -------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _call_item(item_id: str, call_id: str, name: str, args: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": args,
        "status": status,
    }


def output_items(answer: ChatAnswer) -> list[dict[str, Any]]:
    """A whole chat answer as output items: reasoning, message, function calls."""
    items = []
    if answer.reasoning:
        items.append(_reasoning_item(new_id("rs"), answer.reasoning))
    if answer.text or not answer.tool_calls:
        items.append(_message_item(new_id("msg"), answer.text, "completed"))
    for call in answer.tool_calls:
        items.append(_call_item(new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


def assistant_message(answer: ChatAnswer) -> dict[str, Any]:
    """The answer as the chat message a later turn's history holds."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if answer.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.tool_calls
        ]
    return msg


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
) -> dict[str, Any]:
    """The response object with `status` (in_progress, completed, incomplete, failed)."""
    body = req.body
    fmt: dict[str, Any] = {"type": "text"}
    if isinstance(body.get("text"), dict) and isinstance(body["text"].get("format"), dict):
        fmt = body["text"]["format"]
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": body.get("temperature"),
        "text": {"format": fmt},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None if usage is None else _usage(usage),
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def final_status(answer: ChatAnswer) -> str:
    return "incomplete" if answer.finish_reason == "length" else "completed"


def to_response(
    req: ResponsesRequest, answer: ChatAnswer, response_id: str, created_at: int
) -> dict[str, Any]:
    """The response for a whole chat answer."""
    return response_object(
        req, response_id, created_at, final_status(answer), output_items(answer), answer.usage
    )


def now() -> int:
    return int(time.time())


# --- stream -------------------------------------------------------------------------------------


class ResponseStream(DeltaStream):
    """The Responses event sequence for one chat stream: `response.created`,
    `response.in_progress`, per output item `response.output_item.added`, its deltas
    (`response.output_text.delta`, `response.reasoning_text.delta`,
    `response.function_call_arguments.delta`) and `.done` events, then `response.completed`
    (or `response.incomplete`; `response.failed` on a stream error)."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        """Output items so far, completed ones whole."""
        self._open: str | None = None
        """Kind of the item being written: "text", "reasoning" or "tool<index>"."""
        self._text: list[str] = []
        self.failed = False

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, usage: Usage | None) -> dict[str, Any]:
        return response_object(
            self.req, self.response_id, self.created_at, status, list(self._items), usage
        )

    def start(self) -> bytes:
        shell = self._response("in_progress", None)
        return self._event("response.created", {"response": shell}) + self._event(
            "response.in_progress", {"response": shell}
        )

    @property
    def _index(self) -> int:
        return len(self._items) - 1

    def _add(self, kind: str, item: dict[str, Any]) -> bytes:
        out = self._close()
        self._open = kind
        self._text = []
        self._items.append(item)
        out += self._event(
            "response.output_item.added", {"output_index": self._index, "item": item}
        )
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": self._index, "content_index": 0,
                 "part": part},
            )  # fmt: skip
        return out

    def _close(self) -> bytes:
        kind = self._open
        if kind is None:
            return b""
        self._open = None
        item = self._items[-1]
        text = "".join(self._text)
        at = {"item_id": item["id"], "output_index": self._index}
        out = b""
        if kind == "text":
            done = _message_item(item["id"], text, "completed")
            part = done["content"][0]
            out += self._event(
                "response.output_text.done", {**at, "content_index": 0, "text": text,
                                              "logprobs": []}
            )  # fmt: skip
            out += self._event("response.content_part.done", {**at, "content_index": 0,
                                                              "part": part})  # fmt: skip
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text)
            out += self._event(
                "response.reasoning_text.done", {**at, "content_index": 0, "text": text}
            )
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out += self._event(
                "response.function_call_arguments.done",
                {**at, "name": item["name"], "arguments": text},
            )
        self._items[-1] = done
        return out + self._event(
            "response.output_item.done", {"output_index": self._index, "item": done}
        )

    def on_text(self, text: str) -> bytes:
        out = b""
        if self._open != "text":
            out = self._add("text", _message_item(new_id("msg"), "", "in_progress"))
        self._text.append(text)
        item_id = self._items[-1]["id"]
        return out + self._event(
            "response.output_text.delta",
            {"item_id": item_id, "output_index": self._index, "content_index": 0,
             "delta": text, "logprobs": []},
        )  # fmt: skip

    def on_reasoning(self, text: str) -> bytes:
        out = b""
        if self._open != "reasoning":
            out = self._add("reasoning", _reasoning_item(new_id("rs"), ""))
        self._text.append(text)
        return out + self._event(
            "response.reasoning_text.delta",
            {"item_id": self._items[-1]["id"], "output_index": self._index,
             "content_index": 0, "delta": text},
        )  # fmt: skip

    def on_tool_call(self, index: int, call_id: str, name: str) -> bytes:
        item = _call_item(new_id("fc"), call_id, name, "", "in_progress")
        return self._add(f"tool{index}", item)

    def on_tool_args(self, index: int, text: str) -> bytes:
        if self._open != f"tool{index}":
            return b""
        self._text.append(text)
        return self._event(
            "response.function_call_arguments.delta",
            {"item_id": self._items[-1]["id"], "output_index": self._index, "delta": text},
        )

    def on_error(self, error: StreamError) -> bytes:
        return self.fail(error.message, error.code or error.type)

    def finish(self, answer: ChatAnswer) -> tuple[bytes, dict[str, Any]]:
        """The closing events once the chat stream ended, and the final response object."""
        out = self._close()
        if not self._items:  # an empty answer is still one (empty) message
            out += self._add("text", _message_item(new_id("msg"), "", "in_progress"))
            out += self._close()
        status = final_status(answer)
        response = self._response(status, answer.usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, {"response": response}), response

    def fail(self, message: str, code: str) -> bytes:
        """`response.failed` with the error: the stream ends there."""
        if self.failed:
            return b""
        self.failed = True
        response = self._response("failed", None)
        response["error"] = {"code": code, "message": message}
        return self._event("response.failed", {"response": response})
