"""Through the router to real SGLang CPU servers: chat and completions, streaming and not, give
the engine's own greedy answer; tools and tool results pass through; usage and `cached_tokens`
come back as SGLang reports them; the directory learns from SGLang's own KV events what each
server holds, the plan sends a held prefix to its holder, and the hits the plan predicted are
the ones SGLang reports cached; the router reads SGLang's load and health as SGLang serves them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from router.backends.sglang import SGLangBackend
from tests.e2e.router_cluster import plan_fields, proxy_client, sse_chunks
from tests.e2e.sglang.conftest import ADMIN, BLOCK, sglang_router_settings
from tests.e2e.vllm.conftest import until
from workers.sglang_cpu.server import SglangServer
from workers.sglang_cpu.setup import SglangCpuInstall
from workers.vllm_cpu.model import SERVED_NAME

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
Pair = tuple[SglangServer, SglangServer]
HIT_TOLERANCE = 0.02
"""How far the directory's predicted prefix hits may be from SGLang's `cached_tokens`."""


def turn(topic: str, n: int = 40) -> list[dict[str, Any]]:
    text = " ".join(f"{topic} step {i}: the agent reads file {i} and calls tool" for i in range(n))
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": text},
    ]


def chat(messages: list[dict[str, Any]], stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **extra,
    }


def completion(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


async def answer(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """One call: (the answer's text, its usage, the router's plan or {} from a server)."""
    headers = headers or {}
    if not body["stream"]:
        r = await client.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        plan = r.headers.get("x-ownerserve-plan")
        return text or "", data["usage"], plan_fields(plan) if plan else {}
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        plan = r.headers.get("x-ownerserve-plan")
        async for chunk in sse_chunks(r):
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta")
                parts.append((delta.get("content") if delta else choice.get("text")) or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(parts), usage, plan_fields(plan) if plan else {}


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def last_plan(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/admin/plans", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    record: dict[str, Any] = r.json()["plans"][-1]
    return record


def predicted_tokens(record: dict[str, Any], prompt_tokens: int) -> int:
    """The prefix the plan counted as held on its worker, in tokens: at most the prompt less
    one token rounded down to a block (an engine computes the prompt's last token)."""
    blocks = int(record["chosen"].get("reused_blocks", 0))
    return min(blocks * BLOCK, (prompt_tokens - 1) // BLOCK * BLOCK)


async def test_answers_through_the_router_are_the_engines_own(
    sglang_install: SglangCpuInstall, sglang_pair: Pair
) -> None:
    servers = {s.name: s for s in sglang_pair}
    settings = sglang_router_settings(sglang_install, sglang_pair)
    calls = [
        ("/v1/chat/completions", chat(turn("parity", 12))),
        ("/v1/chat/completions", chat(turn("parity-stream", 12), stream=True)),
        ("/v1/completions", completion("the agent opens the file and reads it " * 8)),
        ("/v1/completions", completion("the agent runs the tests again " * 8, stream=True)),
    ]
    async with proxy_client(settings) as (client, _):
        client.timeout = httpx.Timeout(300.0)
        for path, body in calls:
            text, usage, plan = await answer(client, path, body)
            assert plan["d"] in servers, plan
            async with httpx.AsyncClient(base_url=servers[plan["d"]].url, timeout=300) as direct:
                want, want_usage, _ = await answer(direct, path, body)
            assert text == want, (path, body["stream"])
            assert usage["completion_tokens"] == want_usage["completion_tokens"] == 8
            assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
            # SGLang counts its prefix cache hits in the usage it sends (`--enable-cache-report`)
            assert "prompt_tokens_details" in usage, usage


async def test_tools_and_tool_results_pass_through(
    sglang_install: SglangCpuInstall, sglang_pair: Pair
) -> None:
    servers = {s.name: s for s in sglang_pair}
    settings = sglang_router_settings(sglang_install, sglang_pair)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "read_file", "arguments": '{"path": "a.py"}'}  # type: ignore[assignment]
    messages = [
        *turn("tools", 6),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print('hello')"},
    ]
    body = chat(messages, tools=tools, tool_choice="auto")
    async with proxy_client(settings) as (client, _):
        client.timeout = httpx.Timeout(300.0)
        text, usage, plan = await answer(client, "/v1/chat/completions", body)
    async with httpx.AsyncClient(base_url=servers[plan["d"]].url, timeout=300) as direct:
        want, want_usage, _ = await answer(direct, "/v1/chat/completions", body)
    assert text == want
    assert usage["prompt_tokens"] == want_usage["prompt_tokens"]


async def test_a_held_prefix_goes_to_its_holder_and_its_hits_are_the_predicted_ones(
    sglang_install: SglangCpuInstall, sglang_pair: Pair
) -> None:
    """An earlier turn ran on s1 behind the router's back: only s1's KV events say so. The next
    turn goes to s1, and every turn's hits are what the plan predicted from the directory."""
    s1 = sglang_pair[1]
    settings = sglang_router_settings(sglang_install, sglang_pair)
    async with proxy_client(settings) as (client, router):
        client.timeout = httpx.Timeout(300.0)
        tokenizer = router.tokenizers.get(SERVED_NAME)

        async def held_by(worker: str, messages: list[dict[str, Any]], blocks: int) -> bool:
            chain = tokenizer.tokenize_chat(None, messages).chain
            return bool((await router.directory.lookup(chain)).longest(worker) >= blocks)

        first = turn("held-prefix")
        chain_len = len(tokenizer.tokenize_chat(None, first).chain)
        assert chain_len >= 10
        async with httpx.AsyncClient(base_url=s1.url, timeout=300) as direct:
            _, usage, _ = await answer(direct, "/v1/chat/completions", chat(first))
        # the router's tokens are the engine's: same chat template, same tokenizer
        assert usage["prompt_tokens"] == tokenizer.tokenize_chat(None, first).prompt_tokens
        await until(lambda: held_by("s1", first, chain_len), 60.0)
        assert not await held_by("s0", first, 1)

        messages = list(first)
        predicted = delivered = 0
        for k in range(4):
            messages += [
                {"role": "assistant", "content": f"done step {k}"},
                {"role": "user", "content": f"Now run test {k} and report what failed."},
            ]
            _, usage, plan = await answer(
                client, "/v1/chat/completions", chat(messages), {"x-session-id": "sglang-held"}
            )
            record = await last_plan(client)
            assert plan["d"] == "s1", plan
            got, want = cached(usage), predicted_tokens(record, int(usage["prompt_tokens"]))
            assert got >= (chain_len - 1) * BLOCK, (k, got)
            assert abs(got - want) <= HIT_TOLERANCE * got, (k, got, want, record["chosen"])
            predicted, delivered = predicted + want, delivered + got
            # the next turn's prediction reads this turn's blocks once s1 published them
            sent, blocks = list(messages), int(usage["prompt_tokens"]) // BLOCK

            async def published(sent: list[dict[str, Any]] = sent, blocks: int = blocks) -> bool:
                return await held_by("s1", sent, blocks)

            await until(published, 60.0)
        assert abs(predicted - delivered) <= HIT_TOLERANCE * delivered


async def test_the_router_reads_sglang_load_and_health_as_sglang_serves_them(
    sglang_install: SglangCpuInstall, sglang_pair: Pair
) -> None:
    s0, _ = sglang_pair
    async with httpx.AsyncClient(base_url=s0.url, timeout=60) as direct:
        metrics = (await direct.get(SGLangBackend.metrics_path)).text
    load = SGLangBackend().parse_load(metrics)
    assert load.kv_capacity_tokens == s0.spec.max_total_tokens
    assert load.prefix_cache_queries > 0  # the warm-up's prompt

    settings = sglang_router_settings(sglang_install, [s0])
    async with proxy_client(settings) as (client, router):
        client.timeout = httpx.Timeout(300.0)
        await until(lambda: _healthy(router, "s0"), 30.0)
        # a long decode, left once the router's scrape of SGLang's metrics shows it running;
        # closing the stream aborts it in SGLang (the router cancels its upstream request)
        body = chat(turn("long-decode", 4), stream=True, max_tokens=2000)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            await until(lambda: _running(router, "s0", lambda n: n >= 1), 120.0)
        await until(lambda: _running(router, "s0", lambda n: n == 0), 120.0)
        assert router.pool.get("s0").load.kv_capacity_tokens == s0.spec.max_total_tokens


async def _healthy(router: Any, worker: str) -> bool:
    return bool(router.pool.get(worker).healthy)


async def _running(router: Any, worker: str, test: Callable[[int], bool]) -> bool:
    return test(int(router.pool.get(worker).load.running))
