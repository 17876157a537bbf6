"""The front doors through the router to a real vLLM CPU worker: one greedy turn on the
Responses API (official `openai` SDK) and one on the Messages API (official `anthropic` SDK)
give the same tokens as the chat-completions path for the same prompt."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from ownerserve.config import settings_from_dict
from tests.e2e.router_cluster import proxy
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
SYSTEM = "You are a coding agent."
USER = "Read the router and explain its retry logic in one line."


async def test_responses_and_messages_match_chat_completions_on_vllm(
    vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer
) -> None:
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5, "connect_timeout_s": 5.0},
            "planner": {"policy": "colocated"},
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": str(Path(vllm_install.model) / "tokenizer.json"),
                    "block_size": 32,
                    "max_model_len": 2048,
                }
            ],
            "workers": [
                {"id": "h0", "url": vllm_hybrid.url, "role": "hybrid", "kind": "vllm",
                 "models": [MODEL]}
            ],
        }
    )  # fmt: skip
    async with proxy(settings) as (url, _):
        timeout = 300.0
        chat_client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout
        )
        chat = await chat_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            max_tokens=8,
            temperature=0,
        )
        text = chat.choices[0].message.content
        assert text and chat.usage is not None

        response = await chat_client.responses.create(
            model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0
        )
        assert response.output_text == text and response.usage is not None
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens

        claude = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=timeout)
        message = await claude.messages.create(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": USER}],
            max_tokens=8,
            extra_body={"temperature": 0},  # the SDK has no sampling parameters any more
        )
        assert message.content[0].type == "text" and message.content[0].text == text
        u = message.usage
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
        assert u.output_tokens == chat.usage.completion_tokens
        await chat_client.close()
        await claude.close()
