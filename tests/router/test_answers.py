"""The tool a request answers and the tool a whole answer calls (`router.answers`): what the
working sets learn tool gaps by; and the output and cached prompt tokens an answer reports."""

from __future__ import annotations

import orjson

from ownerserve.config import WorkerSettings
from router.answers import (
    cached_tokens,
    completion_tokens,
    delivered_tokens,
    tool_answered,
    tool_called,
)
from router.executor import OpenedResponse
from router.pool import worker_state


def test_the_tool_a_request_answers_is_found_through_its_call_id() -> None:
    messages = [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "read", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "pytest", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "..."},
        {"role": "tool", "tool_call_id": "b", "content": "1 failed"},
    ]
    assert tool_answered(messages) == "pytest"
    assert tool_answered(messages[:3]) == "read"
    assert tool_answered(messages[:1]) is None  # no tool result last
    assert tool_answered([{"role": "tool", "tool_call_id": "x"}]) is None  # no call for it
    assert tool_answered(None) is None and tool_answered([]) is None


def test_the_tool_a_whole_answer_calls_compact_or_spaced() -> None:
    answer = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "grep", "arguments": "{}"}}],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    assert tool_called(orjson.dumps(answer)) == "grep"
    spaced = orjson.dumps(answer).replace(b'":', b'": ')
    assert tool_called(spaced) == "grep"
    answer["choices"][0]["finish_reason"] = "stop"
    assert tool_called(orjson.dumps(answer)) is None


def test_the_cached_tokens_an_answer_reports_whole_spaced_streamed_or_not_at_all() -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    whole = orjson.dumps({"choices": [{"message": {"content": "hi"}}], "usage": usage})
    assert cached_tokens(whole) == 32
    assert cached_tokens(whole.replace(b'":', b'": ')) == 32
    assert completion_tokens(whole) == 3
    # a message quoting the key has it escaped: only the usage's counts
    quoted = {"content": '{"cached_tokens": 999}'}
    body = orjson.dumps({"choices": [{"message": quoted}], "usage": usage})
    assert cached_tokens(body) == 32
    assert cached_tokens(orjson.dumps({"choices": [{"message": quoted}]})) is None
    details_null = {**usage, "prompt_tokens_details": {"cached_tokens": None}}
    assert cached_tokens(orjson.dumps({"usage": details_null})) is None
    assert cached_tokens(b"") is None and completion_tokens(b"") == 0
    # a stream's last reads: its usage chunk, then [DONE]
    tail = b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    assert cached_tokens(tail) == 32


def _opened(first: bytes, prefill_answer: bytes | None = None) -> OpenedResponse:
    state = worker_state(WorkerSettings(id="w0", url="http://127.0.0.1:9"))
    return OpenedResponse(200, b"application/json", first, state, prefill_answer=prefill_answer)


def test_what_was_delivered_is_the_prefill_workers_report() -> None:
    def answer(cached: int) -> bytes:
        return orjson.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": cached}}})

    assert delivered_tokens(_opened(answer(8)), False, b"") == 8  # whole: its body
    assert delivered_tokens(_opened(b"data: {}"), True, answer(12)) == 12  # streamed: its tail
    assert delivered_tokens(_opened(answer(8)), True, b"data: [DONE]") is None
    # a remote prefill: P's answer says what P held (D counts P's KV as cached too)
    assert delivered_tokens(_opened(answer(40), answer(16)), False, b"") == 16
    assert delivered_tokens(_opened(answer(40), b"{}"), False, b"") is None
