"""Agent frameworks from PyPI driving multi-turn tool loops to completion through the router's
Responses front door, against emulated workers in tool-calling mode (real processes): the
OpenAI Agents SDK (an agent with a function tool, then a run continued by
`previous_response_id`) and LangChain's `ChatOpenAI` on the Responses API with bound tools."""

from __future__ import annotations

import openai
import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from ownerserve.config import Settings, settings_from_dict
from tests.e2e.router_cluster import proxy, workers_fixture

pytestmark = pytest.mark.timeout(120)


TOOL_CALLS = ("--tool-call-every", "1", "--output-len", "12")
workers = workers_fixture(lambda: (EmulatedWorker("ag0", "hybrid", speed=50, extra=TOOL_CALLS),))


def settings(workers: tuple[EmulatedWorker, ...]) -> Settings:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5},
            "models": [{"name": MODEL}],
            "workers": [w.worker_settings() for w in workers],
        }
    )


async def test_openai_agents_sdk_runs_a_function_tool_loop_to_completion(workers):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async with proxy(settings(workers)) as (url, router):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = agents.Agent(
            name="forecaster", instructions="Use tools.", tools=[get_weather], model=model
        )
        result = await agents.Runner.run(agent, "What's the weather in Paris?", max_turns=4)
        assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
        # the next run continues the stored conversation instead of resending it
        again = await agents.Runner.run(
            agent, "And in Rome?", previous_response_id=result.last_response_id, max_turns=4
        )
        assert len(calls) == 2 and again.final_output
        # the four model calls of both runs are one session: the run resends its conversation
        # (its stable prefix keys it), the next run chains it (the chain keeps the key)
        sessions = [p.session_id for p in router.recent_plans]
        assert len(sessions) == 4 and len(set(sessions)) == 1 and sessions[0]
        await client.close()


async def test_langchain_chat_openai_on_responses_api_loops_tools_to_completion(workers):
    lc_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def lookup(term: str) -> str:
        """Look a term up."""
        return f"{term}: a thing"

    async with proxy(settings(workers)) as (url, _):
        llm = lc_openai.ChatOpenAI(
            model=MODEL, base_url=url + "/v1", api_key="x", use_responses_api=True, max_retries=0
        ).bind_tools([lookup])
        history: list = [HumanMessage("What is a KV cache?")]
        for _ in range(4):
            ai = await llm.ainvoke(history)
            history.append(ai)
            if not ai.tool_calls:
                break
            for call in ai.tool_calls:
                history.append(ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]))
        kinds = [type(m).__name__ for m in history]
        assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
        assert history[-1].text and not history[-1].tool_calls
