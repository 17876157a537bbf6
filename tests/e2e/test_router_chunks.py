"""Chunk reuse through the router to emulated engines (real processes): a chunk computed for
one prompt is reused by the next at another position, on the worker holding it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import ChunkSettings, ModelSettings
from ownerserve.types import KVPath
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
        # no KV API on either worker: the other worker cannot fetch the chunk, only its holder
        # reuses it (the fetch is the next test's)
        no_api = tuple(
            w.model_copy(update={"kv_paths": (KVPath.NIXL_PD,)}) for w in settings.workers
        )
        settings = settings.model_copy(
            update={
                "models": (ModelSettings(name=MODEL, chunks=ChunkSettings()),),
                "workers": no_api,
            }
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


async def test_chunks_held_by_the_other_worker_are_fetched_instead_of_recomputed() -> None:
    h0 = EmulatedWorker("h0", "hybrid", speed=20)
    h1 = EmulatedWorker("h1", "hybrid", speed=20)
    with emulated_workers(h0, h1) as ws:
        settings = router_settings(ws, server={"admin_token": "adm"})
        settings = settings.model_copy(
            update={"models": (ModelSettings(name=MODEL, chunks=ChunkSettings()),)}
        )
        admin = {"x-admin-token": "adm"}
        async with proxy_client(settings) as (client, _):
            # DOC_A's KV on h0 only, DOC_B's on h1 only (the other worker drained meanwhile)
            assert (await client.post("/admin/workers/h1/drain", headers=admin)).is_success
            first = await ask(client, [DOC_A], "What does the gateway retry?")
            assert plan_fields(first.headers["x-ownerserve-plan"])["p"] == "h0"
            assert (await client.post("/admin/workers/h1/undrain", headers=admin)).is_success
            assert (await client.post("/admin/workers/h0/drain", headers=admin)).is_success
            second = await ask(client, [DOC_B], "When do leases expire?")
            assert plan_fields(second.headers["x-ownerserve-plan"])["p"] == "h1"
            assert (await client.post("/admin/workers/h0/undrain", headers=admin)).is_success
            stored = "ownerserve_emulator_chunk_tokens_stored_total"
            own = {w.worker_id: metric_value(w.metrics(), stored) for w in (h0, h1)}
            # both chunks behind a new one (no prefix hit): whichever worker runs it fetches
            # the one it lacks from the other, and computes the new one
            both = await ask(client, [DOC_C, DOC_B, DOC_A], "Summarise them.")
            assert both.status_code == 200, both.text
            plan = plan_fields(both.headers["x-ownerserve-plan"])
            assert plan["chunks"] == "1/1/1", plan
            ran, other = (h0, h1) if plan["p"] == "h0" else (h1, h0)
            cached = both.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            text, other_text = ran.metrics(), other.metrics()
            assert metric_value(text, "ownerserve_emulator_chunks_fetched_total") == 1
            fetched = metric_value(text, "ownerserve_emulator_chunk_tokens_fetched_total")
            sent = metric_value(other_text, "ownerserve_emulator_kv_sent_bytes_total", kind="chunk")
            got = metric_value(text, "ownerserve_emulator_kv_received_bytes_total", kind="chunk")
            assert sent == got > 0
            # its own chunk (stored by its first request) and the fetched one are both copied,
            # not computed, and count as cached tokens
            own_tokens = own[ran.worker_id]
            reused = metric_value(text, "ownerserve_emulator_chunk_tokens_reused_total")
            assert fetched > 0 and own_tokens > 0
            assert reused == own_tokens + fetched
            assert cached >= reused
