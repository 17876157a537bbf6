"""What a request's prompt and answer say that its accounting needs (`router.lease`,
`router.aftermath`): the tool whose result a chat's last message carries, the tool a whole
answer calls, how many output tokens an answer had, and how many prompt tokens its prefill
worker reported cached."""

from __future__ import annotations

from typing import Any

from router.executor import OpenedResponse


def tool_answered(messages: list[Any] | None) -> str | None:
    """The name of the tool whose result ends a chat's messages (the tool gap this request
    closes was that tool's), found through the assistant's call of that id; None otherwise."""
    if not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "tool":
        return None
    call_id = last.get("tool_call_id")
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            if isinstance(call, dict) and call.get("id") == call_id:
                fn = call.get("function")
                name = fn.get("name") if isinstance(fn, dict) else None
                return name if isinstance(name, str) else None
        return None
    return None


_TOOL_CALLS = (b'"finish_reason":"tool_calls"', b'"finish_reason": "tool_calls"')
_NAMES = (b'"name":"', b'"name": "')


def tool_called(body: bytes) -> str | None:
    """The function a whole chat answer calls (its first tool call's name) when it finished
    with `tool_calls`, found without parsing or copying the body (compact JSON or with a
    space after the colons); None otherwise."""
    if not any(key in body for key in _TOOL_CALLS):
        return None
    for key in _NAMES:
        i = body.find(key)
        if i >= 0:
            i += len(key)
            j = body.find(b'"', i)
            return body[i:j].decode("utf-8", "replace") if j > i else None
    return None


def output_tokens(opened: OpenedResponse | None, streamed: bool, events: int) -> int | None:
    """The output tokens of an answered request (streamed: its output `events`; whole:
    `usage.completion_tokens`); None when it was not answered (nothing opened, or not a 200)."""
    if opened is None or opened.status != 200:
        return None
    return events if streamed else completion_tokens(opened.first)


def completion_tokens(body: bytes) -> int:
    """`usage.completion_tokens` of a whole OpenAI answer, found without parsing it (0 if
    absent)."""
    return _number_after(body, b'"completion_tokens":') or 0


def _number_after(body: bytes, key: bytes) -> int | None:
    """The integer after the last `key` in `body` (spaces after it skipped); None when `key`
    is absent or no digits follow (`null`)."""
    i = body.rfind(key)
    if i < 0:
        return None
    i += len(key)
    while i < len(body) and body[i] == 0x20:
        i += 1
    j = i
    while j < len(body) and 0x30 <= body[j] <= 0x39:
        j += 1
    return int(body[i:j]) if j > i else None


def cached_tokens(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an OpenAI answer (a whole body, or the
    tail of a stream holding its usage chunk), found without parsing it: the last such key
    (a message quoting the key has it escaped, `\\"`, so it never matches); None when the
    answer does not report it."""
    return _number_after(body, b'"cached_tokens":')


def delivered_tokens(opened: OpenedResponse, streamed: bool, tail: bytes) -> int | None:
    """The prompt tokens an answered request's prefill worker reported cached: P's answer's
    after a remote prefill (`OpenedResponse.prefill_answer`), else the answer's own (whole:
    its body; streamed: `tail`, its last reads, where the usage chunk is when the client asked
    for one); None when the answer does not say."""
    if opened.prefill_answer is not None:
        return cached_tokens(opened.prefill_answer)
    return cached_tokens(tail if streamed else opened.first)
