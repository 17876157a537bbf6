"""Reading chat completions back: whole answers, and streams split anywhere into deltas."""

from __future__ import annotations

import orjson

from router.frontdoors.chat import (
    ChatStreamReader,
    SSEDecoder,
    StreamError,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    Usage,
    answer_of,
    error_of,
)


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM = b"".join(
    [
        sse({"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        sse({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        sse({"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}}]}),
        sse({"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "ls", "arguments": '{"a"'}}]}}]}),
        sse({"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]}),
        sse({"id": "c1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 5}}}),
        b"data: [DONE]\n\n",
    ]
)  # fmt: skip


def test_a_stream_split_at_every_byte_reads_as_whole():
    whole = ChatStreamReader()
    deltas = whole.feed(STREAM)
    assert deltas == [
        TextDelta("Hel"),
        TextDelta("lo"),
        ToolCallStart(0, "call_1", "ls"),
        ToolArgsDelta(0, '{"a"'),
        ToolArgsDelta(0, ": 1}"),
    ]
    split = ChatStreamReader()
    pieces = [d for i in range(len(STREAM)) for d in split.feed(STREAM[i : i + 1])]
    assert pieces == deltas and split.done
    answer = split.answer()
    assert answer.text == "Hello" and answer.finish_reason == "tool_calls"
    assert answer.tool_calls == (ToolCall("call_1", "ls", '{"a": 1}'),)
    assert answer.usage == Usage(9, 4, 5)


def test_crlf_events_and_multi_line_data_decode():
    assert SSEDecoder().feed(b"event: x\r\ndata: a\r\ndata: b\r\n\r\ndata: c") == [b"a\nb"]


def test_an_error_event_in_the_stream_is_a_stream_error():
    reader = ChatStreamReader()
    err = {"error": {"message": "worker died", "type": "upstream_error", "code": None}}
    assert reader.feed(sse(err)) == [StreamError("worker died", "upstream_error", None)]
    assert reader.error is not None and not reader.done


def test_whole_answer_and_error_bodies():
    body = {
        "id": "c2",
        "choices": [
            {
                "index": 0,
                "message": {"content": "hi", "reasoning_content": "think", "tool_calls": []},
                "finish_reason": "stop",
                "stop_reason": "END",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    answer = answer_of(body)
    assert (answer.text, answer.reasoning, answer.stop_reason) == ("hi", "think", "END")
    assert answer.usage == Usage(3, 1, 0)
    flat = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    assert error_of(flat) == StreamError("bad", "BadRequestError", "400")
    assert error_of({"choices": []}) is None
