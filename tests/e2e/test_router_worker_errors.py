"""A worker's error answers as the router counts them, against real emulated workers: a 4xx
the worker answered is counted under its status in `ownerserve_requests_total` (not as `ok`),
the client's own mistakes leave the worker's circuit breaker alone, and the 4xx that say the
worker cannot serve what the router sent it (a model it does not have) count against it. The
front doors count what they refuse before the pipeline too."""

from __future__ import annotations

from typing import Any

import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from ownerserve.config import settings_from_dict
from tests.e2e.router_cluster import metric_value, proxy_client, workers_fixture

pytestmark = pytest.mark.timeout(120)

OTHER = "a-model-the-worker-lacks"

hybrid = workers_fixture(lambda: (EmulatedWorker("h0", "hybrid", speed=50),))


def _settings(worker: EmulatedWorker) -> Any:
    """The router in front of `worker`, configured (wrongly) as if it also served `OTHER`."""
    entry = worker.worker_settings()
    entry["models"] = [MODEL, OTHER]
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "models": [{"name": MODEL}, {"name": OTHER, "tokenizer": "byte"}],
            "workers": [entry],
        }
    )


def _chat(model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Which file holds the retry loop?"}],
        "max_tokens": 4,
        **extra,
    }


async def test_a_workers_4xx_is_counted_by_status_and_only_its_own_faults_reach_the_breaker(
    hybrid,
):
    (worker,) = hybrid
    async with proxy_client(_settings(worker)) as (client, router):
        state = router.pool.get("h0")
        # the client's mistake, refused by the worker: a tool_choice naming no tool it sent
        bad_tool = {"type": "function", "function": {"name": "missing"}}
        tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
        resp = await client.post(
            "/v1/chat/completions", json=_chat(tools=tools, tool_choice=bad_tool)
        )
        assert resp.status_code == 400, resp.text
        assert "missing" in resp.json()["error"]["message"]
        assert state.breaker.failures == 0
        # the worker lacks a model the router sent it: the worker's fault
        resp = await client.post("/v1/chat/completions", json=_chat(OTHER))
        assert resp.status_code == 404, resp.text
        assert state.breaker.failures == 1
        ok = await client.post("/v1/chat/completions", json=_chat())
        assert ok.status_code == 200
        # a front door's refusal before the pipeline
        resp = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": "four"})
        assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text

        text = (await client.get("/metrics")).text
        requests = "ownerserve_requests_total"
        assert metric_value(text, requests, status="400") == 2
        assert metric_value(text, requests, status="404") == 1
        assert metric_value(text, requests, status="ok") == 1
