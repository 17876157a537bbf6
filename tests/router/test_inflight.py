"""The tool a request answers and the tool a whole answer calls (`router.inflight`): what the
working sets learn tool gaps by."""

from __future__ import annotations

import orjson

from router.inflight import tool_answered, tool_called


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
