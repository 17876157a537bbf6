"""The front doors with the official SDKs against real processes: the router (its own HTTP
server) in front of emulated workers in tool-calling mode. Responses (plain, streamed, function
tools, `previous_response_id` over several turns, retrieve, delete; continued through a second
replica with Redis) and Anthropic Messages (plain, streamed, tool use and tool results,
count_tokens), and bad input on both in each route's own error shape."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import openai
import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from ownerserve.config import Settings, settings_from_dict
from tests.e2e.router_cluster import plan_fields, proxy, workers_fixture

pytestmark = pytest.mark.timeout(120)

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
    },
}


TOOL_CALLS = ("--tool-call-every", "1", "--output-len", "12")
workers = workers_fixture(
    lambda: (
        EmulatedWorker("f0", "hybrid", speed=50, extra=TOOL_CALLS),
        EmulatedWorker("f1", "hybrid", speed=50, extra=TOOL_CALLS),
    )
)


def settings_for(workers: tuple[EmulatedWorker, ...], **sections: Any) -> Settings:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5, **sections.pop("server", {})},
            "models": [{"name": MODEL}],
            "workers": [w.worker_settings() for w in workers],
            **sections,
        }
    )


def oa(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


# --- Responses ----------------------------------------------------------------------------------


async def test_responses_plain_streamed_and_continued_over_turns(workers):
    async with proxy(settings_for(workers)) as (url, router):
        client = oa(url)
        first = await client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8)
        assert first.status == "incomplete" and first.output_text
        assert first.usage is not None and first.usage.output_tokens == 8
        assert first.output[0].type == "message"

        stream = await client.responses.create(
            model=MODEL, input="Hello there", max_output_tokens=8, stream=True
        )
        kinds, deltas, final = [], [], None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.incomplete" and "response.output_item.done" in kinds
        assert final is not None and "".join(deltas) == final.output_text == first.output_text
        assert final.usage is not None and final.usage.input_tokens == first.usage.input_tokens

        # three more turns on the first one, each on the stored conversation
        previous, inputs = first, [first.usage.input_tokens]
        for turn in range(3):
            nxt = await client.responses.create(
                model=MODEL,
                input=f"and turn {turn}?",
                previous_response_id=previous.id,
                max_output_tokens=8,
            )
            assert nxt.previous_response_id == previous.id and nxt.output_text
            assert nxt.usage is not None
            inputs.append(nxt.usage.input_tokens)
            previous = nxt
        assert inputs == sorted(inputs) and len(set(inputs)) == 4  # the history grows
        # the conversation is one session (so one owner) whether chained or resent
        sessions = {p.session_id for p in router.recent_plans}
        assert len(sessions) == 1 and router.sessions.get(sessions.pop()) is not None

        got = await client.responses.retrieve(previous.id)
        assert got.id == previous.id and got.output_text == previous.output_text
        await client.responses.delete(previous.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(previous.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(
                model=MODEL, input="again", previous_response_id=previous.id
            )
        assert missing.value.code == "previous_response_not_found"
        unstored = await client.responses.create(model=MODEL, input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        await client.close()


async def test_responses_function_tool_loop_streamed_and_not(workers):
    async with proxy(settings_for(workers)) as (url, _):
        client = oa(url)
        asked = await client.responses.create(
            model=MODEL, input="What's the weather in Paris?", tools=[WEATHER]
        )
        calls = [o for o in asked.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        args = json.loads(calls[0].arguments)
        assert set(args) == {"city", "unit", "days"} and args["unit"] in ("c", "f")
        assert 1 <= args["days"] <= 7 and isinstance(args["city"], str)

        answered = await client.responses.create(
            model=MODEL,
            previous_response_id=asked.id,
            input=[
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
            ],
            tools=[WEATHER],
        )
        assert [o.type for o in answered.output] == ["message"] and answered.output_text

        stream = await client.responses.create(
            model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], stream=True
        )
        arg_deltas, done_item = [], None
        async for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arg_deltas.append(event.delta)
            if event.type == "response.output_item.done":
                done_item = event.item
        assert done_item is not None and done_item.type == "function_call"
        assert "".join(arg_deltas) == done_item.arguments == calls[0].arguments
        await client.close()


async def test_responses_bad_input_is_a_4xx_in_openai_shape(workers):
    settings = settings_for(workers, server={"max_body_bytes": 4096})
    async with proxy(settings) as (url, _), httpx.AsyncClient(base_url=url) as http:
        client = oa(url)
        with pytest.raises(openai.BadRequestError, match="unsupported input item"):
            bogus: Any = [{"type": "bogus"}]
            await client.responses.create(model=MODEL, input=bogus)
        with pytest.raises(openai.BadRequestError, match="not served by this router"):
            await client.responses.create(
                model=MODEL, input="hi", tools=[{"type": "web_search_preview"}]
            )
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="no-such-model", input="hi")
        for body in (b"[1, 2]", b"{not json", b'{"model": "m"}'):
            resp = await http.post("/v1/responses", content=body)
            assert resp.status_code == 400 and resp.json()["error"]["type"]
        big = await http.post("/v1/responses", json={"model": MODEL, "input": "x" * 8192})
        assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"
        cancel = await http.post("/v1/responses/resp_unknown/cancel")
        assert cancel.status_code == 404 and "error" in cancel.json()
        wrong = await http.put("/v1/responses/resp_unknown")
        assert wrong.status_code == 405
        await client.close()


async def test_responses_size_bound_refuses_a_conversation_grown_past_it(workers):
    settings = settings_for(workers, responses={"max_conversation_bytes": 600})
    async with proxy(settings) as (url, _):
        client = oa(url)
        first = await client.responses.create(model=MODEL, input="a" * 300, max_output_tokens=4)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=MODEL, input="b" * 300, previous_response_id=first.id, max_output_tokens=4
            )
        assert refused.value.code == "conversation_too_large"
        await client.close()


@pytest.mark.redis
async def test_a_conversation_continues_through_another_replica_with_redis(workers, redis_server):
    directory = {
        "backend": "redis",
        "redis_url": redis_server.url,
        "key_prefix": f"fd-{uuid.uuid4().hex[:8]}",
    }
    settings = settings_for(workers, directory=directory, responses={"ttl_s": 60})
    async with proxy(settings) as (url_a, router_a), proxy(settings) as (url_b, router_b):
        a, b = oa(url_a), oa(url_b)
        first = await a.responses.create(model=MODEL, input="Start here", max_output_tokens=6)
        raw = await b.responses.with_raw_response.create(
            model=MODEL, input="go on", previous_response_id=first.id, max_output_tokens=6
        )
        second = raw.parse()
        assert second.previous_response_id == first.id and second.output_text
        assert plan_fields(raw.headers["x-ownerserve-plan"])["action"]
        # the same conversation, the same session on either replica
        assert router_b.recent_plans[-1].session_id == router_a.recent_plans[-1].session_id
        third = await a.responses.create(
            model=MODEL, input="and?", previous_response_id=second.id, max_output_tokens=6
        )
        assert third.usage is not None and second.usage is not None
        assert third.usage.input_tokens > second.usage.input_tokens
        assert (await b.responses.retrieve(third.id)).output_text == third.output_text
        await b.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(third.id)
        await a.close()
        await b.close()


# --- Anthropic Messages -------------------------------------------------------------------------

READ_FILE: Any = {
    "name": "read_file",
    "description": "Read a file.",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["path"],
    },
}


def an(url: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, **kwargs)


async def test_messages_plain_streamed_and_counted(workers):
    async with proxy(settings_for(workers)) as (url, _):
        client = an(url)
        ask: Any = [{"role": "user", "content": "Say something about caches."}]
        whole = await client.messages.create(
            model=MODEL, max_tokens=6, system="You are terse.", messages=ask
        )
        assert whole.type == "message" and whole.role == "assistant"
        assert whole.stop_reason == "max_tokens" and whole.content[0].type == "text"
        assert whole.usage.output_tokens == 6
        async with client.messages.stream(
            model=MODEL, max_tokens=6, system="You are terse.", messages=ask
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
        counted = await client.messages.count_tokens(
            model=MODEL, system="You are terse.", messages=ask
        )
        u = whole.usage
        assert counted.input_tokens == u.input_tokens + (u.cache_read_input_tokens or 0)
        await client.close()


async def test_messages_tool_use_then_tool_result_streamed_and_not(workers):
    async with proxy(settings_for(workers)) as (url, _):
        client = an(url)
        ask: Any = [{"role": "user", "content": "Open the README."}]
        used = await client.messages.create(
            model=MODEL, max_tokens=64, messages=ask, tools=[READ_FILE]
        )
        assert used.stop_reason == "tool_use"
        call = next(b for b in used.content if b.type == "tool_use")
        assert call.name == "read_file" and isinstance(call.input["path"], str)
        async with client.messages.stream(
            model=MODEL, max_tokens=64, messages=ask, tools=[READ_FILE]
        ) as stream:
            streamed = await stream.get_final_message()
        streamed_call = next(b for b in streamed.content if b.type == "tool_use")
        assert streamed.stop_reason == "tool_use" and streamed_call.input == call.input

        turn: Any = [
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "# hi"}],
            },
        ]
        done = await client.messages.create(
            model=MODEL, max_tokens=64, messages=turn, tools=[READ_FILE]
        )
        assert done.stop_reason == "end_turn" and done.content[0].type == "text"
        assert done.usage.input_tokens + (done.usage.cache_read_input_tokens or 0) > (
            used.usage.input_tokens + (used.usage.cache_read_input_tokens or 0)
        )
        await client.close()


async def test_messages_claude_code_session_header_keys_the_session(workers):
    async with proxy(settings_for(workers)) as (url, router):
        client = an(url, default_headers={"x-claude-code-session-id": "cc-session-1"})
        await client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert router.sessions.get("cc-session-1") is not None
        await client.close()


async def test_messages_bad_input_is_a_4xx_in_anthropic_shape(workers):
    settings = settings_for(workers, server={"max_body_bytes": 4096, "api_keys": ["sk-a"]})
    async with proxy(settings) as (url, _), httpx.AsyncClient(base_url=url) as http:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="sk-a", max_retries=0)
        unknown_block: Any = [{"role": "user", "content": [{"type": "x"}]}]
        with pytest.raises(anthropic.BadRequestError) as bad_block:
            await client.messages.create(
                model=MODEL,
                max_tokens=4,
                messages=unknown_block,
            )
        assert bad_block.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(
                model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert unknown.value.body["type"] == "error"  # type: ignore[index]
        bad_key = anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await bad_key.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        headers = {"x-api-key": "sk-a"}
        for body in (
            {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]},
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{}]}]},
            {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
        ):
            resp = await http.post("/v1/messages", json=body, headers=headers)
            assert resp.status_code == 400
            assert resp.json()["type"] == "error"
            assert resp.json()["error"]["type"] == "invalid_request_error"
        big = await http.post(
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x" * 8192}],
            },
            headers=headers,
        )
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        await client.close()
        await bad_key.close()
