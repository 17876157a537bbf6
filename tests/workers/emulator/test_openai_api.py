"""The official `openai` client, sync, async and streaming, works against the emulated engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.workers.emulator.conftest import StartEmulator
from workers.emulator.config import DEFAULT_MODEL as MODEL

OpenAIClient = Callable[..., Awaitable[openai.AsyncOpenAI]]

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files in the repository and explain the layout."},
]


@pytest.fixture
async def openai_client(start_emulator: StartEmulator) -> AsyncIterator[OpenAIClient]:
    """Call with `EmulatorConfig` fields: an async `openai` client of an engine started with
    them; closed at teardown."""
    clients: list[openai.AsyncOpenAI] = []

    async def start(**overrides: Any) -> openai.AsyncOpenAI:
        server = await start_emulator(**overrides)
        clients.append(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x"))
        return clients[-1]

    try:
        yield start
    finally:
        for client in clients:
            await client.close()


async def test_async_client_chat_completion_has_text_usage_and_is_deterministic(
    openai_client: OpenAIClient,
) -> None:
    client = await openai_client()
    first = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    again = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 24
    assert first.usage.total_tokens == first.usage.prompt_tokens + 24
    assert again.choices[0].message.content == first.choices[0].message.content
    other = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, seed=7
    )
    assert other.choices[0].message.content != first.choices[0].message.content
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_async_streaming_matches_the_non_streamed_text_and_reports_usage(
    openai_client: OpenAIClient,
) -> None:
    client = await openai_client()
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 40


async def test_natural_end_of_text_finishes_with_stop(openai_client: OpenAIClient) -> None:
    client = await openai_client(output_len=12)
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == 13  # 12 + EOS


async def test_completions_with_n_and_stop_string(openai_client: OpenAIClient) -> None:
    client = await openai_client()
    resp = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, n=3
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    texts = [c.text for c in resp.choices]
    assert len(set(texts)) == 3
    assert resp.usage is not None and resp.usage.completion_tokens == 90
    # Cut the first choice at a substring of its own text: the stop string is excluded.
    word = texts[0].split()[2]
    cut = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, stop=[" " + word]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == texts[0][: texts[0].index(" " + word)]
    streamed = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, stop=[" " + word], stream=True
    )
    text = ""
    async for chunk in streamed:
        text += "".join(c.text for c in chunk.choices)
    assert text == cut.choices[0].text


async def test_logprobs_have_openai_shape(openai_client: OpenAIClient) -> None:
    client = await openai_client()
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.content)
    assert "".join(t.token for t in lp.content) == resp.choices[0].message.content
    comp = await client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=1)
    assert comp.choices[0].logprobs is not None
    assert len(comp.choices[0].logprobs.tokens or []) == 4


async def test_tools_are_accepted(openai_client: OpenAIClient) -> None:
    client = await openai_client()
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=8,
        tools=tools,
        tool_choice="auto",
    )
    with_tools = resp.usage.prompt_tokens if resp.usage else 0
    plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert plain.usage is not None and with_tools > plain.usage.prompt_tokens


@pytest.mark.timeout(60)
async def test_sync_client_works_unchanged(start_emulator: StartEmulator) -> None:
    server = await start_emulator()

    def use_sync_client() -> tuple[str, str]:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16)
        parts: list[str] = []
        for chunk in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, stream=True
        ):
            parts.extend(c.delta.content or "" for c in chunk.choices)
        client.close()
        return whole.choices[0].message.content or "", "".join(parts)

    whole, streamed = await asyncio.to_thread(use_sync_client)
    assert whole and whole == streamed


async def test_batched_prompts_and_continuous_usage(start_emulator: StartEmulator) -> None:
    import httpx

    server = await start_emulator()
    async with httpx.AsyncClient(base_url=server.url) as http:
        resp = await http.post(
            "/v1/completions", json={"prompt": ["first prompt", "second one"], "max_tokens": 3,
                                     "n": 2}
        )  # fmt: skip
        body = resp.json()
        assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
        assert body["usage"]["completion_tokens"] == 12
        assert body["usage"]["prompt_tokens"] == len("first prompt") + len("second one")
        streamed = await http.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )  # fmt: skip
        chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
        counts = [orjson.loads(c[6:])["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 4


async def test_forced_tool_choice_returns_a_tool_call_streamed_or_not(
    openai_client: OpenAIClient,
) -> None:
    import json

    client = await openai_client(output_len=10)
    tools: Any = [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}},
    ]
    named: Any = {"type": "function", "function": {"name": "cat"}}
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice=named
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "cat"  # type: ignore[union-attr]
    arguments = calls[0].function.arguments  # type: ignore[union-attr]
    assert set(json.loads(arguments)) == {"input"}
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice=named, stream=True
    )
    streamed = ""
    finish = None
    async for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                streamed += (call.function.arguments if call.function else None) or ""
            finish = c.finish_reason or finish
    assert streamed == arguments and finish == "tool_calls"
    required = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=3
    )
    assert required.choices[0].finish_reason == "length"
    assert (required.choices[0].message.tool_calls or [])[0].function.name == "ls"  # type: ignore[union-attr]


async def test_a_stream_sends_nothing_before_its_first_token(
    start_emulator: StartEmulator,
) -> None:
    """The role chunk comes with the first token, as vLLM sends it (on its engine's first
    output): a router that counts a prefill as queued until the first body bytes, and
    measures TTFT by them, must not see them while the prefill is still waiting."""
    server = await start_emulator()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    async with (
        httpx.AsyncClient(base_url=server.url) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        first = b""
        async for part in resp.aiter_raw():
            first = part
            break
        events = [
            orjson.loads(line[6:]) for line in first.splitlines() if line.startswith(b"data: {")
        ]
        deltas = [e["choices"][0]["delta"] for e in events]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert any(d.get("content") for d in deltas[1:])  # the first token is in the same bytes
