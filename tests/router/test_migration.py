"""Mid-stream migration's pure parts (`router.migration`): what a stream's transcript keeps and
lets through, what a continuation asks the next worker, how its stream is spliced into the
answer the client is getting; and the request's lease moving its holds from the worker that
failed to the one that took over, once."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from planner.types import Action
from router.lease import RequestLease
from router.migration import (
    KEEP_BYTES,
    Splice,
    Transcript,
    asks_usage,
    continuation,
    ending,
    unmigratable,
)
from router.requests import CompletionRequest, Endpoint, parse_request
from tests.router.test_pipeline import _counts, _opened, _plan, _planned, _router

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}


def chat_event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({**HEAD, "choices": [choice], **extra}) + b"\n\n"


def chat(**body: Any) -> CompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return parse_request(
        orjson.dumps({"model": "tiny", "messages": messages, "stream": True, **body}),
        Endpoint.CHAT,
    )


def completion(**body: Any) -> CompletionRequest:
    return parse_request(
        orjson.dumps({"model": "tiny", "stream": True, **body}), Endpoint.COMPLETIONS
    )


def encode(text: str) -> list[int]:
    return list(text.encode())


# --- the transcript ---------------------------------------------------------------------------


def test_a_transcript_lets_whole_events_through_and_holds_back_a_half_sent_one():
    t = Transcript()
    role = chat_event({"role": "assistant", "content": ""})
    hello = chat_event({"content": "Hello"})
    assert t.keep(role + hello[:20]) == role  # the client never gets half an event
    assert t.keep(hello[20:30]) == b""
    assert t.keep(hello[30:]) == hello
    partial = t.partial()
    assert partial.text == "Hello" and partial.chat
    assert dict(partial.head) == {"id": "chatcmpl-1", "created": 7, "model": "tiny"}
    assert partial.finish_reason is None and not partial.done and partial.why_not is None


def test_a_stream_that_ends_without_a_blank_line_gets_its_last_bytes_at_its_end():
    t = Transcript()
    assert t.keep(b"data: [DONE]") == b""
    assert t.flush() == b"data: [DONE]" and t.flush() == b""


def test_crlf_separated_events_pass_whole():
    t = Transcript()
    event = chat_event({"content": "a"}).replace(b"\n\n", b"\r\n\r\n")
    assert t.keep(event + event[:9]) == event
    assert t.keep(event[9:]) == event
    assert t.partial().text == "aa"


def test_a_long_stream_is_parsed_as_it_goes_and_keeps_its_whole_text():
    t = Transcript()
    event = chat_event({"content": "word "})
    n = KEEP_BYTES // len(event) * 3
    for _ in range(n):
        t.keep(event)
    assert t._size <= KEEP_BYTES  # parsed into text beyond the bound
    assert t.partial().text == "word " * n


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, "tool call"),
        ({"reasoning_content": "Let me think"}, "reasoning"),
    ],
)
def test_what_cannot_be_resent_as_text_is_named(delta: dict[str, Any], why: str):
    t = Transcript()
    t.keep(chat_event({"content": "ok"}) + chat_event(delta))
    reason = t.partial().why_not
    assert reason is not None and why in reason


def test_the_workers_own_error_event_is_not_continued():
    t = Transcript()
    t.keep(chat_event({"content": "ok"}) + b'data: {"error": {"message": "aborted"}}\n\n')
    assert t.partial().why_not == "the worker's own error event reached the client"


def test_a_final_chunk_usage_and_done_are_seen():
    t = Transcript()
    usage = b"data: " + orjson.dumps({**HEAD, "choices": [], "usage": {}}) + b"\n\n"
    t.keep(chat_event({"content": "x"}, "stop") + usage + b"data: [DONE]\n\n")
    p = t.partial()
    assert (p.finish_reason, p.usage_sent, p.done) == ("stop", True, True)


# --- which requests may move -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"regex": "a+"}, "regex"),
        ({"n": 2}, "several choices"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tool_choice",
        ),
    ],
)
def test_constrained_or_several_choice_requests_do_not_move(body: dict[str, Any], why: str):
    reason = unmigratable(chat(**body))
    assert reason is not None and why in reason


def test_plain_requests_move():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert unmigratable(chat()) is None
    assert unmigratable(chat(response_format={"type": "text"})) is None
    assert unmigratable(chat(tools=tools, tool_choice="auto", temperature=0.7)) is None
    assert unmigratable(completion(prompt="once")) is None
    assert unmigratable(completion(prompt=[1, 2, 3])) is None
    assert unmigratable(completion(prompt=["a", "b"])) is not None
    assert unmigratable(completion(prompt="a", echo=True)) is not None


# --- the continuation ---------------------------------------------------------------------------


def test_a_chat_continuation_carries_the_partial_answer_and_the_sampling_settings():
    req = chat(
        max_tokens=100, min_tokens=10, temperature=0.3, top_p=0.9, seed=5, stop=["\n"],
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True},
    )  # fmt: skip
    following = continuation(req, "Hello wor", 9, encode)
    assert following is not None
    body = orjson.loads(following.raw)
    assert body == following.body
    assert body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello wor"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"], following.max_tokens) == (91, 1, 91)
    for key in ("temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs"):
        assert body[key] == req.body[key]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert req.body["messages"] == [{"role": "user", "content": "hi"}]  # the client's untouched


def test_a_clients_own_continued_message_is_extended():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    req = chat(messages=messages, continue_final_message=True, add_generation_prompt=False)
    following = continuation(req, " upon", 2, encode)
    assert following is not None
    assert following.body["messages"][-1] == {"role": "assistant", "content": "Once upon"}


def test_a_completion_continues_its_text_or_its_token_ids():
    text = continuation(completion(prompt="Once", max_tokens=8, echo=False), " upon", 5, encode)
    ids = continuation(completion(prompt=[1, 2], max_tokens=8), "ab", 2, encode)
    assert text is not None and ids is not None
    assert text.body["prompt"] == "Once upon" and "echo" not in text.body
    assert ids.body["prompt"] == [1, 2, 97, 98] and ids.body["max_tokens"] == 6


def test_no_continuation_once_the_token_limit_is_spent_and_the_same_prompt_before_any_text():
    assert continuation(chat(max_completion_tokens=4), "abcd", 4, encode) is None
    again = continuation(chat(max_tokens=4), "", 0, encode)
    assert again is not None and again.body["messages"] == [{"role": "user", "content": "hi"}]
    assert "continue_final_message" not in again.body


# --- the splice --------------------------------------------------------------------------------


def test_a_continuations_chunks_become_the_answers():
    splice = Splice({"id": "chatcmpl-1", "created": 7, "model": "tiny"}, 30, 9)
    other = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 9, "model": "m"}

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**other, **obj}) + b"\n\n"

    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    text = event({"choices": [{"index": 0, "delta": {"content": "ld"}, "finish_reason": None}]})
    usage: dict[str, Any] = {"prompt_tokens": 39, "completion_tokens": 5, "total_tokens": 44}
    usage["prompt_tokens_details"] = {"cached_tokens": 36}
    last = event({"choices": [], "usage": usage})
    stream = role + text + last + b"data: [DONE]\n\n"
    out = splice.feed(stream[:50]) + splice.feed(stream[50:]) + splice.flush()
    lines = [line for line in out.split(b"\n\n") if line]
    assert len(lines) == 3 and lines[-1] == b"data: [DONE]" and splice.events == 3
    first, final = orjson.loads(lines[0][6:]), orjson.loads(lines[1][6:])
    assert first["choices"][0]["delta"] == {"content": "ld"}
    for chunk in (first, final):
        assert (chunk["id"], chunk["created"], chunk["model"]) == ("chatcmpl-1", 7, "tiny")
    assert final["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 14,
        "total_tokens": 44,
        "prompt_tokens_details": {"cached_tokens": 30},
    }


def test_an_error_event_from_the_continuation_passes_as_it_is():
    splice = Splice(HEAD, 1, 1)
    error = b'data: {"error": {"message": "no"}}\n\n'
    assert splice.feed(error) == error


def test_an_answer_whose_worker_failed_after_its_last_token_is_ended_by_the_router():
    t = Transcript()
    t.keep(chat_event({"content": "abc"}, "stop"))
    tail = ending(t.partial(), 10, 3, include_usage=True)
    lines = [line for line in tail.split(b"\n\n") if line]
    assert lines[-1] == b"data: [DONE]" and len(lines) == 2
    usage = orjson.loads(lines[0][6:])
    assert usage["id"] == "chatcmpl-1" and usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    t = Transcript()
    t.keep(chat_event({"content": "abc"}))
    cut_at_limit = ending(t.partial(), 10, 3, include_usage=False)
    final = orjson.loads(cut_at_limit.split(b"\n\n")[0][6:])
    assert final["choices"][0]["finish_reason"] == "length"
    assert asks_usage(chat(stream_options={"include_usage": True}))
    assert not asks_usage(chat())


# --- the lease ----------------------------------------------------------------------------------


async def test_a_migration_moves_the_leases_holds_from_the_failed_worker_to_the_new_one_once():
    router = _router(workers=2, admission=True)
    await router.open_directory()
    prompt, match, _, _ = await _planned(router)
    n = prompt.tokens
    w0, w1 = router.pool.get("w0"), router.pool.get("w1")
    assert w0 is not None and w1 is not None
    ws = router.working_sets
    with RequestLease(router.services.lease, prompt) as lease:
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w0", "w0"), match)
        first = _opened(router, "w0")
        lease.plan_opened(first)
        lease.answer_started(first)
        assert _counts(router) == [(1, 0, n), (0, 0, 0)]
        assert router.admission.working_set(w0).since_scrape == n
        lease.answer_cut(n + 10)  # w0 failed mid-stream, 10 tokens in
        assert _counts(router) == [(0, 0, 0), (0, 0, 0)]
        assert router.admission.working_set(w0).since_scrape == 0
        assert ws.home("s1", time.monotonic())[0] == "w0"  # the session's KV still counted
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w1", "w1"), match)
        assert ws.home("s1", time.monotonic()) == ("w1", n + 10)  # moved with the plan
        second = _opened(router, "w1")
        lease.plan_opened(second)
        lease.answer_started(second)
        assert _counts(router) == [(0, 0, 0), (1, 0, n + 10)]
        assert router.admission.working_set(w1).since_scrape == n + 10
        lease.answer_ended(25)
        assert _counts(router) == [(0, 0, 0), (0, 0, 0)]
        assert router.admission.working_set(w1).since_scrape == 0
    assert router.leases.open == 0
    assert not {s: v.inflight for s, v in ws._sessions.items() if v.inflight}
    # answered: its KV (the prompt and the answer so far, at least) kept where it finished
    assert ws.home("s1", time.monotonic()) == ("w1", n + 10)


async def test_a_migration_no_worker_takes_over_gives_everything_back_as_a_failure():
    router = _router(workers=2, admission=True)
    await router.open_directory()
    prompt, match, _, _ = await _planned(router)
    with RequestLease(router.services.lease, prompt) as lease:
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w0", "w0"), match)
        first = _opened(router, "w0")
        lease.plan_opened(first)
        lease.answer_started(first)
        lease.answer_cut(prompt.tokens + 3)
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w1", "w1"), match)
        lease.plan_failed()  # the continuation failed before its first byte: no one left
    assert _counts(router) == [(0, 0, 0), (0, 0, 0)] and router.leases.open == 0
    assert router.working_sets.home("s1", 0.0) == (None, 0)  # released, as a failure's
