"""The emulated engine's tool-calling mode (`--tool-call-every k`): with tools offered, every
k-th user turn is a tool call whose arguments fit the tool's schema; a turn ending in tool
results is answered in text, so agent loops end."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from ownerserve.errors import ConfigError
from tests.workers.emulator.conftest import StartEmulator
from workers.emulator.config import DEFAULT_MODEL as MODEL
from workers.emulator.config import EmulatorConfig
from workers.emulator.textgen import tool_call_shape

SCHEMA: Any = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["r", "w"]},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}},
        "opts": {"type": "object", "properties": {"follow": {"type": "boolean"}}},
        "note": {"type": "string"},
    },
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "read", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
]


def test_arguments_fit_the_schema_and_carry_the_text_in_the_first_string():
    shape = tool_call_shape("read", SCHEMA, seed=7)
    args = json.loads(shape.arguments('say "hi"'))
    assert args["path"] == 'say "hi"' and args["mode"] in ("r", "w")
    assert all(1 <= n <= 9 for n in args["lines"]) and isinstance(args["opts"]["follow"], bool)
    assert isinstance(args["note"], str) and args["note"] != args["path"]
    assert shape == tool_call_shape("read", SCHEMA, seed=7)  # seeded: deterministic
    assert json.loads(tool_call_shape("ls", {"type": "object"}, 1).arguments("x")) == {"input": "x"}
    numbers = tool_call_shape("n", {"type": "object", "properties": {"n": {"type": "number"}}}, 1)
    assert not numbers.carries_text and set(json.loads(numbers.arguments("ignored"))) == {"n"}
    odd = {"type": "object", "properties": {"k": {"type": "integer", "minimum": "x"}, "o": {
        "type": "object", "properties": [1]}}}  # fmt: skip
    assert set(json.loads(tool_call_shape("odd", odd, 1).arguments(""))) == {"k", "o"}


def test_a_negative_period_is_a_config_error():
    with pytest.raises(ConfigError, match="tool-call-every"):
        EmulatorConfig(tool_call_every=-1)


async def test_every_kth_user_turn_calls_a_tool_and_tool_results_get_text(
    start_emulator: StartEmulator,
) -> None:
    server = await start_emulator(tool_call_every=2, output_len=6)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
    one: Any = [{"role": "user", "content": "first"}]
    first = await client.chat.completions.create(model=MODEL, messages=one, tools=TOOLS)
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.content
    two: Any = [*one, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "read"}]
    second = await client.chat.completions.create(model=MODEL, messages=two, tools=TOOLS)
    choice = second.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "read"  # type: ignore[union-attr]
    assert set(json.loads(call.function.arguments)) == set(SCHEMA["properties"])  # type: ignore[union-attr]

    stream = await client.chat.completions.create(
        model=MODEL, messages=two, tools=TOOLS, stream=True
    )
    streamed, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                streamed += (d.function.arguments if d.function else None) or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and streamed == call.function.arguments  # type: ignore[union-attr]

    answered: Any = [
        *two,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "data"},
    ]
    last = await client.chat.completions.create(model=MODEL, messages=answered, tools=TOOLS)
    assert last.choices[0].finish_reason == "stop" and not last.choices[0].message.tool_calls
    none = await client.chat.completions.create(
        model=MODEL, messages=two, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].finish_reason == "stop"
    await client.close()
