"""OpenAI Responses <-> chat completions, without servers."""

from __future__ import annotations

import orjson
import pytest

from ownerserve.errors import InvalidRequestError
from router.frontdoors import responses
from router.frontdoors.chat import (
    ChatAnswer,
    ReasoningDelta,
    StreamError,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
)


def test_input_items_become_chat_messages_with_calls_merged():
    msgs = responses.input_messages(
        [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "hi "},
                         {"type": "input_text", "text": "you"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "text"}]},
        ]
    )  # fmt: skip
    assert msgs == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi you"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "text"},
    ]
    assert responses.input_messages("plain") == [{"role": "user", "content": "plain"}]


def test_chat_request_puts_instructions_first_then_history_then_input():
    req = responses.parse(
        {
            "model": "m",
            "input": "next",
            "instructions": "be brief",
            "max_output_tokens": 7,
            "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "ls"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            "temperature": 0.5,
            "reasoning": {"effort": "low"},
            "stream": True,
        }
    )
    history = ({"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"})
    chat = responses.chat_request(req, history)
    assert [m["content"] for m in chat["messages"]] == ["be brief", "first", "ok", "next"]
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0.5
    assert chat["reasoning_effort"] == "low"
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    schema = {"name": "x", "schema": {}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": 3}, "input"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "unsupported"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "role"),
        ({"model": "m", "input": [{"role": ["user"], "content": "x"}]}, "role"),
        ({"model": "m", "input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}, "not served"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "previous_response_id": 5}, "previous_response_id"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "format"),
    ],
)
def test_bad_requests_are_invalid_request_errors(body, match):
    with pytest.raises(InvalidRequestError, match=match):
        responses.parse(body)


REQ = responses.parse({"model": "m", "input": "hi", "metadata": {"k": "v"}})


def test_whole_answer_output_items_and_status():
    answer = ChatAnswer(
        "c", "ok", "why", (ToolCall("call_1", "ls", "{}"),), "tool_calls", None, Usage(9, 2, 3)
    )
    resp = responses.to_response(REQ, answer, "resp_1", 100)
    assert [o["type"] for o in resp["output"]] == ["reasoning", "message", "function_call"]
    assert resp["output"][1]["content"][0]["text"] == "ok"
    assert resp["output"][2]["call_id"] == "call_1" and resp["status"] == "completed"
    assert resp["usage"]["input_tokens_details"] == {"cached_tokens": 3}
    assert resp["usage"]["total_tokens"] == 11 and resp["metadata"] == {"k": "v"}
    cut = ChatAnswer("c", "o", "", (), "length", None, Usage())
    resp = responses.to_response(REQ, cut, "resp_2", 100)
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert responses.assistant_message(answer)["tool_calls"][0]["id"] == "call_1"


def events(raw: bytes) -> list[dict]:
    return [orjson.loads(b.split(b"\n")[1][6:]) for b in raw.split(b"\n\n") if b]


def test_stream_event_sequence_numbers_items_and_final_response():
    s = responses.ResponseStream(REQ, "resp_1", 100)
    raw = s.start() + s.feed(
        [
            ReasoningDelta("r"),
            TextDelta("a"),
            TextDelta("b"),
            ToolCallStart(0, "call_1", "ls"),
            ToolArgsDelta(0, "{"),
            ToolArgsDelta(0, "}"),
        ]
    )
    tail, final = s.finish(ChatAnswer("c", "ab", "r", (), "tool_calls", None, Usage(4, 3, 0)))
    seq = events(raw + tail)
    assert [e["sequence_number"] for e in seq] == list(range(len(seq)))
    kinds = [e["type"] for e in seq]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    )
    text_done = next(e for e in seq if e["type"] == "response.output_text.done")
    assert text_done["text"] == "ab" and text_done["output_index"] == 1
    args_done = next(e for e in seq if e["type"] == "response.function_call_arguments.done")
    assert args_done["arguments"] == "{}"
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == "{}" and final["usage"]["output_tokens"] == 3


def test_an_empty_answer_is_one_empty_message_and_an_error_fails_the_response():
    s = responses.ResponseStream(REQ, "resp_1", 100)
    _, final = s.finish(ChatAnswer("c", "", "", (), "stop", None, Usage()))
    assert [o["type"] for o in final["output"]] == ["message"]
    f = responses.ResponseStream(REQ, "resp_2", 100)
    failed = events(f.feed([TextDelta("a"), StreamError("boom", "upstream_error", None)]))
    assert failed[-1]["type"] == "response.failed"
    assert failed[-1]["response"]["error"] == {"code": "upstream_error", "message": "boom"}
    assert f.feed([TextDelta("more")]) == b""


def test_conversation_round_trips_through_bytes():
    conv = responses.Conversation("conv", ({"role": "user", "content": "x"},), {"id": "r"})
    assert responses.Conversation.from_bytes(conv.to_bytes()) == conv
