"""`continue_final_message`, as vLLM takes it: the prompt ends inside the final assistant
message, which the emulated engine continues (what the router sends to continue an answer on
another worker, `router.migration`)."""

from __future__ import annotations

import httpx

from tests.workers.emulator.conftest import StartEmulator
from workers.emulator.config import DEFAULT_MODEL as MODEL

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files in the repository."},
]
PARTIAL = "The repository holds"


async def test_a_continued_message_is_the_prompt_with_the_partial_answer_and_no_new_turn(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator()
    url = server.url + "/v1/chat/completions"
    opened = await http.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8})
    continued = await http.post(
        url,
        json={
            "model": MODEL,
            "messages": [*MESSAGES, {"role": "assistant", "content": PARTIAL}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 8,
        },
    )
    assert opened.status_code == 200 and continued.status_code == 200, continued.text
    # byte tokens: the original prompt (up to the assistant's turn) and the partial answer,
    # without the end of the assistant's message a closed turn would have
    prompt = opened.json()["usage"]["prompt_tokens"]
    assert continued.json()["usage"]["prompt_tokens"] == prompt + len(PARTIAL)
    assert continued.json()["choices"][0]["message"]["content"]


async def test_continue_final_message_with_a_generation_prompt_is_refused_as_vllm_refuses_it(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    server = await start_emulator()
    resp = await http.post(
        server.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [*MESSAGES, {"role": "assistant", "content": PARTIAL}],
            "continue_final_message": True,
        },
    )
    assert resp.status_code == 400
    assert "continue_final_message" in resp.json()["error"]["message"]
