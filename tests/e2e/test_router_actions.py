"""Through the router to emulated engines (real processes), with the real `ownerserve` policy
and the in-process directory: every action the planner can choose is executed on the workers'
own protocols — remote prefill (vLLM and SGLang), decode continuation on the session owner,
colocated prefill, artifact fetch."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from tests.e2e.router_cluster import (
    FAST_DECODE_PROFILE,
    MODEL,
    metric_value,
    plan_fields,
    proxy_client,
    router_settings,
    sse_chunks,
    workers_fixture,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools.\n"}
REPO = "".join(
    f"def handler_{i}(request):\n    return route(request, shard={i})\n" for i in range(90)
)


def long_turn(question: str) -> list[dict[str, Any]]:
    """A first turn of ~6k tokens (byte tokenizer): a new long prefix."""
    return [SYSTEM, {"role": "user", "content": "Repository:\n" + REPO + question}]


async def chat(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], session: str, **extra: Any
) -> tuple[dict[str, str], str, dict[str, Any]]:
    """Stream one chat turn; returns (plan, text, usage)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-session-id": session}
    ) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        plan = plan_fields(resp.headers["x-ownerserve-plan"])
        async for chunk in sse_chunks(resp):
            for choice in chunk.get("choices") or ():
                text.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return plan, "".join(text), usage


@contextlib.asynccontextmanager
async def decode_load(client: httpx.AsyncClient, router: Any, worker: str, streams: int = 20):
    """Keep `streams` long decodes running on `worker` (the router counts them in flight), as
    a busy decode worker would be; cancelled on exit."""

    async def one(i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"background job {i}"}],
            "max_tokens": 3000,
            "stream": True,
        }
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-session-id": f"bg-{i}"}
        ) as resp:
            async for _ in resp.aiter_bytes():
                pass

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    try:
        await until(lambda: router.pool.get(worker).inflight >= streams)
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # until the router sees the worker idle again (its scraped gauges lag by up to one
        # health interval)
        state = router.pool.get(worker)
        await until(
            lambda: state.inflight == 0 and state.load.running == 0 and state.load.waiting == 0
        )


async def first_session_on_h0(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> tuple[list[dict[str, Any]], str]:
    """Drain h1 (through the admin API, `admin` its headers) and plan session A's long first
    turn, which runs colocated on h0: (its messages, its text). h1 stays drained."""
    assert (await client.post("/admin/workers/h1/drain", headers=admin)).is_success
    first = long_turn("Question A?")
    plan, text, _ = await chat(client, first, "session-a")
    assert (plan["action"], plan["d"]) == ("colocated_prefill", "h0")
    return first, text


pd_vllm = workers_fixture(
    lambda: (EmulatedWorker("p0", "prefill", speed=4), EmulatedWorker("d0", "decode", speed=4))
)
pd_sglang = workers_fixture(
    lambda: (
        EmulatedWorker("sp0", "prefill", kind="sglang", speed=4),
        EmulatedWorker("sd0", "decode", kind="sglang", speed=4),
    )
)


async def test_remote_prefill_vllm_protocol_then_decode_continuation_on_the_owner(pd_vllm):
    p0, d0 = pd_vllm
    async with proxy_client(router_settings(pd_vllm)) as (client, router):
        messages = long_turn("Why does handler_7 fail?")
        async with decode_load(client, router, "d0"):
            plan, text, usage = await chat(client, messages, "agent-1")
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "d0")
        assert text and usage["prompt_tokens"] > 5000
        assert metric_value(d0.metrics(), "ownerserve_emulator_kv_received_blocks_total",
                            kind="pd") > 300  # fmt: skip
        assert metric_value(p0.metrics(), "ownerserve_emulator_kv_sent_blocks_total",
                            kind="pd") > 300  # fmt: skip
        # the commit runs concurrently with the stream's tail: wait for it (a loaded machine
        # can delay it well past any fixed sleep)
        chain = router.tokenizers.get(MODEL).tokenize_chat(None, messages).chain

        async def committed() -> bool:
            match = await router.directory.lookup(chain, "agent-1")
            return match.owner == "d0" and match.session_owner == "d0"

        await until(committed, what="d0 the owner of agent-1's prefix")

        turn2 = [*messages, {"role": "assistant", "content": text[:20]},
                 {"role": "tool", "content": "ok"}]  # fmt: skip
        plan2, text2, usage2 = await chat(client, turn2, "agent-1")
        assert (plan2["action"], plan2["d"]) == ("decode_continuation", "d0"), str(plan2)
        assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
        assert text2


async def test_remote_prefill_sglang_protocol(pd_sglang):
    _, sd0 = pd_sglang
    async with (
        proxy_client(router_settings(pd_sglang)) as (client, router),
        decode_load(client, router, "sd0"),
    ):
        plan, text, usage = await chat(client, long_turn("Explain shard 3."), "agent-2")
    assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "sp0", "sd0")
    assert text and usage["prompt_tokens"] > 5000
    assert metric_value(sd0.metrics(), "ownerserve_emulator_kv_received_blocks_total",
                        kind="pd") > 300  # fmt: skip


async def test_colocated_prefill_then_artifact_fetch_to_a_faster_decoder():
    slow = EmulatedWorker("h0", "hybrid", speed=20)
    fast = EmulatedWorker("h1", "hybrid", profile=FAST_DECODE_PROFILE, speed=20)
    with emulated_workers(slow, fast) as ws:
        settings = router_settings(ws, server={"admin_token": "adm"})
        admin = {"x-admin-token": "adm"}
        async with proxy_client(settings) as (client, _):
            # h1 joins later: the first session's prefix is computed on h0
            await first_session_on_h0(client, admin)
            assert (await client.post("/admin/workers/h1/undrain", headers=admin)).is_success
            # another session sharing the long prefix: pull it to the fast decoder
            plan_b, text_b, usage_b = await chat(client, long_turn("Question B?"), "session-b")
            assert plan_b["action"] == "artifact_fetch"
            assert (plan_b["src"], plan_b["d"], plan_b["fetched"]) == ("h0", "h1", "1")
            assert text_b
            assert usage_b["prompt_tokens_details"]["cached_tokens"] > 5000
            fetched = metric_value(
                fast.metrics(), "ownerserve_emulator_kv_received_blocks_total", kind="fetch"
            )
            assert fetched > 300
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_plan_actions_total",
                                action="artifact_fetch") == 1  # fmt: skip
            assert metric_value(metrics, "ownerserve_transfer_seconds_count",
                                action="artifact_fetch") == 1  # fmt: skip
