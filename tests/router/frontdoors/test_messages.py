"""Anthropic Messages <-> chat completions, without servers."""

from __future__ import annotations

import orjson
import pytest

from ownerserve.errors import InvalidRequestError
from router.frontdoors import messages
from router.frontdoors.chat import (
    ChatAnswer,
    StreamError,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
)

BASE = {"model": "m", "max_tokens": 16}


def test_system_blocks_tool_use_and_tool_results_become_chat_messages():
    chat = messages.to_chat(
        {
            **BASE,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "list files"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Sure."},
                        {"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "."}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "a.py"},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 5,
            "stream": True,
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "t1", "type": "function",
                 "function": {"name": "ls", "arguments": '{"dir":"."}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    assert chat["tools"][0]["function"] == {
        "name": "ls",
        "parameters": {"type": "object"},
        "description": "list",
    }
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and chat["max_tokens"] == 16
    assert chat["stream_options"] == {"include_usage": True}


def test_images_in_a_tool_result_follow_the_tool_message_in_a_user_message():
    image = {"type": "image", "source": {"type": "url", "url": "http://x/shot.png"}}
    chat = messages.to_chat(
        {**BASE, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "took it"}, image]}]}]}
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "took it"},
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "http://x/shot.png"}}]},
    ]  # fmt: skip


def test_structured_output_becomes_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = messages.to_chat(
        {**BASE, "messages": [{"role": "user", "content": "x"}],
         "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )  # fmt: skip
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    with pytest.raises(InvalidRequestError, match="output_config"):
        messages.to_chat({**BASE, "messages": [{"role": "user", "content": "x"}],
                          "output_config": {"format": {"type": "yaml"}}})  # fmt: skip


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({**BASE, "max_tokens": True, "messages": [{"role": "user", "content": "x"}]}, "max_tok"),
        ({**BASE, "messages": []}, "messages"),
        ({**BASE, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "audio"),
        ({**BASE, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]},
         "tools"),
        (
            {**BASE, "messages": [{"role": "user", "content": "x"}],
             "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "client tools",
        ),
        ({**BASE, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_c"),
        ({**BASE, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({**BASE, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": 1}},
         "output_config"),
    ],
)  # fmt: skip
def test_bad_requests_are_invalid_request_errors(body, match):
    with pytest.raises(InvalidRequestError, match=match):
        messages.to_chat(body)


def test_error_body_has_anthropics_shape_and_types():
    assert orjson.loads(messages.error_body(404, "no")) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no"},
    }
    assert messages.error_type(413) == "request_too_large"
    assert messages.error_type(503) == "overloaded_error"
    assert messages.error_type(502) == "api_error"
    assert messages.error_type(422) == "invalid_request_error"


def test_whole_answer_with_tool_call_and_stop_sequence():
    answer = ChatAnswer(
        "c", "ok", "", (ToolCall("t1", "ls", '{"d": 1}'),), "tool_calls", None, Usage(10, 3, 4)
    )
    msg = messages.to_message(answer, "m", "msg_1")
    assert msg["content"] == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "t1", "name": "ls", "input": {"d": 1}},
    ]
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"]["input_tokens"] == 6 and msg["usage"]["cache_read_input_tokens"] == 4
    stopped = ChatAnswer("c", "x", "", (), "stop", "END", Usage())
    assert messages.to_message(stopped, "m", "i")["stop_reason"] == "stop_sequence"
    assert messages.to_message(stopped, "m", "i")["stop_sequence"] == "END"


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n")
            out.append((head[7:].decode(), orjson.loads(data[6:])))
    return out


def test_stream_events_open_and_close_one_block_at_a_time():
    s = messages.MessageStream("m", "msg_1")
    raw = s.start() + s.feed(
        [TextDelta("a"), TextDelta("b"), ToolCallStart(0, "t1", "ls"), ToolArgsDelta(0, "{}")]
    )
    raw += s.finish(ChatAnswer("c", "ab", "", (), "tool_calls", None, Usage(5, 2, 0)))
    seq = events(raw)
    assert [name for name, _ in seq] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert seq[5][1]["content_block"] == {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}
    assert seq[6][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert seq[8][1]["delta"]["stop_reason"] == "tool_use"
    assert seq[8][1]["usage"]["output_tokens"] == 2


def test_a_stream_error_ends_the_stream_with_an_error_event():
    s = messages.MessageStream("m", "msg_1")
    raw = s.feed([TextDelta("a"), StreamError("boom", "upstream_error", None), TextDelta("b")])
    seq = events(raw)
    assert seq[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    assert s.finish(ChatAnswer("c", "", "", (), None, None, Usage())) == b""
