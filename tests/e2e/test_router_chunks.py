"""Chunk reuse through the router to emulated engines (real processes): a chunk computed for
one prompt is reused by the next at another position, on the worker holding it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import ChunkSettings, ModelSettings
from tests.e2e.router_cluster import MODEL, metric_value, plan_fields, proxy_client, router_settings

pytestmark = pytest.mark.timeout(120)

SYSTEM = {"role": "system", "content": "Answer from the documents.\n"}
DOC_A = "".join(f"Alpha fact {i}: the gateway retries idempotent calls.\n" for i in range(24))
DOC_B = "".join(f"Bravo fact {i}: leases expire after five minutes.\n" for i in range(24))
DOC_C = "".join(f"Charlie fact {i}: shards rebalance at midnight.\n" for i in range(24))


async def ask(client: httpx.AsyncClient, docs: list[str], question: str) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Context##" + "##".join(docs) + "##" + question},
        ],
        "max_tokens": 2,
    }
    return await client.post("/v1/chat/completions", json=body)


async def test_a_chunk_is_reused_at_another_position_on_the_worker_holding_it() -> None:
    h0 = EmulatedWorker("h0", "hybrid", speed=20)
    h1 = EmulatedWorker("h1", "hybrid", speed=20)
    with emulated_workers(h0, h1) as ws:
        settings = router_settings(ws)
        settings = settings.model_copy(
            update={"models": (ModelSettings(name=MODEL, chunks=ChunkSettings()),)}
        )
        async with proxy_client(settings) as (client, _):
            first = await ask(client, [DOC_A, DOC_B], "When do leases expire?")
            assert first.status_code == 200, first.text
            holder = plan_fields(first.headers["x-ownerserve-plan"])["p"]
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # DOC_A again, now second and after a new chunk: only chunk reuse can find it
            second = await ask(client, [DOC_C, DOC_A], "What does the gateway retry?")
            assert second.status_code == 200, second.text
            plan = plan_fields(second.headers["x-ownerserve-plan"])
            assert plan["p"] == holder  # chunk affinity
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(DOC_A) - 1
            worker = h0 if holder == "h0" else h1
            text = worker.metrics()
            assert metric_value(text, "ownerserve_emulator_chunk_tokens_reused_total") == len(DOC_A)
            computed = metric_value(text, "ownerserve_emulator_prefill_tokens_computed_total")
            prompts = (
                first.json()["usage"]["prompt_tokens"] + second.json()["usage"]["prompt_tokens"]
            )
            assert computed <= prompts - len(DOC_A)
            # a malformed chunked prompt is a 400 in the OpenAI shape
            messages = [SYSTEM, {"role": "user", "content": "Context## one separator only"}]
            bad = await client.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": messages}
            )
            assert bad.status_code == 400
            assert "unbalanced" in bad.json()["error"]["message"]
