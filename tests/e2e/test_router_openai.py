"""The official `openai` client, unchanged, against the router in front of emulated engines:
chat (streaming and not) with tools and tool-call history, completions, models, and the
errors it maps to its exception types."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from loadgen.cluster import EmulatedWorker
from tests.e2e.router_cluster import (
    MODEL,
    plan_fields,
    proxy,
    router_settings,
    workers_fixture,
)

pytestmark = pytest.mark.timeout(120)

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
HISTORY: list[Any] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What does src/app.py do?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "def main():\n    serve()\n"},
]


hybrids = workers_fixture(
    lambda: (EmulatedWorker("h0", "hybrid", speed=50), EmulatedWorker("h1", "hybrid", speed=50))
)


async def test_openai_client_streaming_with_tools_and_usage(hybrids):
    settings = router_settings(hybrids, server={"api_keys": ["sk-router"], "max_body_bytes": 65536})
    async with proxy(settings) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-router", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=HISTORY,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-session-id": "oa-1"},
        )
        text, usage = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
            usage = chunk.usage or usage
        assert "".join(text)
        assert usage is not None and usage.completion_tokens > 0

        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=HISTORY,
            tools=TOOLS,
            max_tokens=4,
            extra_headers={"x-session-id": "oa-1"},
        )
        plan = plan_fields(raw.headers["x-ownerserve-plan"])
        completion = raw.parse()
        assert completion.choices[0].message.role == "assistant"
        assert completion.usage is not None
        assert completion.usage.prompt_tokens_details is not None
        # same session, same prompt: served where its prefix lives, from the cache
        assert completion.usage.prompt_tokens_details.cached_tokens
        assert plan["d"] in ("h0", "h1")

        done = await client.completions.create(model=MODEL, prompt="def main():", max_tokens=5)
        assert done.choices[0].text is not None and done.usage is not None
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_openai_client_sees_openai_errors(hybrids):
    settings = router_settings(hybrids, server={"api_keys": ["sk-router"], "max_body_bytes": 4096})
    async with proxy(settings) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-router", max_retries=0)
        with pytest.raises(openai.NotFoundError) as nf:
            await client.chat.completions.create(
                model="gpt-nope", messages=[{"role": "user", "content": "hi"}]
            )
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[])
        with pytest.raises(openai.APIStatusError) as big:
            await client.completions.create(model=MODEL, prompt="x" * 10000)
        assert big.value.status_code == 413
        intruder = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await intruder.models.list()


async def test_an_unkeyed_session_sticks_to_its_owner_and_forks_are_recognised(hybrids):
    # The workers outlive earlier tests' routers: this router's subscribers join their event
    # streams mid-sequence, which must not cost the session owner the first turn commits.
    settings = router_settings(hybrids)
    async with proxy(settings) as (url, router):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages: list[Any] = [
            {"role": "system", "content": "You are a coding agent working on a repository."},
            {"role": "user", "content": "Find why the retry test fails. " * 8},
        ]
        first = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        owner = plan_fields(first.headers["x-ownerserve-plan"])["d"]
        answer = first.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "tool", "content": "ok"}]
        second = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        plan = plan_fields(second.headers["x-ownerserve-plan"])
        assert (plan["action"], plan["d"]) == ("decode_continuation", owner), str(plan)
        # two branches from the same point: n > 1 is a forked rollout
        forked = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4, n=2
        )
        assert plan_fields(forked.headers["x-ownerserve-plan"])["class"] == "forked_rollout"
        assert len(forked.parse().choices) == 2
        assert router.recent_plans[-1].session_id.startswith("auto-")
