"""Workers failing under the router, for real: an emulated engine SIGKILLed mid-stream ends
the client's stream with an error event and `[DONE]` (never a hang) when the answer may not
move (`server.max_migrations: 0`; moving it: `test_router_migration.py`), and a dead worker
that the router still believes alive is retried on another before any byte reaches the
client."""

from __future__ import annotations

import time

import orjson
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from tests.e2e.router_cluster import (
    MODEL,
    metric_value,
    plan_fields,
    proxy_client,
    router_settings,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 20},
]


async def test_worker_killed_mid_stream_ends_the_stream_with_an_error_event():
    workers = (EmulatedWorker("h0", "hybrid", speed=1), EmulatedWorker("h1", "hybrid", speed=1))
    with emulated_workers(*workers) as ws:
        by_id = {w.worker_id: w for w in ws}
        settings = router_settings(ws, server={"max_migrations": 0})
        async with proxy_client(settings) as (client, router):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True}
            lines: list[str] = []
            t0 = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                victim = by_id[plan_fields(resp.headers["x-ownerserve-plan"])["d"]]
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 3:
                            victim.kill()
            assert time.monotonic() - t0 < 30
            assert lines[-1] == "data: [DONE]"
            error = orjson.loads(lines[-2][6:])["error"]
            assert error["type"] == "upstream_error"
            assert victim.worker_id in error["message"]
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_stream_errors_total") == 1
            # the router notices the death and stops routing there
            await until(lambda: not router.pool.get(victim.worker_id).healthy)
            again = await client.post(
                "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}
            )
            assert again.status_code == 200
            assert plan_fields(again.headers["x-ownerserve-plan"])["d"] != victim.worker_id


async def test_dead_session_owner_is_retried_on_another_worker_before_the_first_byte():
    workers = (EmulatedWorker("h0", "hybrid", speed=50), EmulatedWorker("h1", "hybrid", speed=50))
    with emulated_workers(*workers) as ws:
        by_id = {w.worker_id: w for w in ws}
        # health checks far apart: the router still believes the killed worker is alive
        settings = router_settings(ws, server={"health_interval_s": 300})
        async with proxy_client(settings) as (client, _):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
            headers = {"x-session-id": "s-retry"}
            first = await client.post("/v1/chat/completions", json=body, headers=headers)
            owner = plan_fields(first.headers["x-ownerserve-plan"])["d"]
            by_id[owner].kill()
            turn2 = [*MESSAGES, {"role": "assistant", "content": "ok"}]
            turn2.append({"role": "user", "content": "go on"})
            second = await client.post(
                "/v1/chat/completions", json={**body, "messages": turn2}, headers=headers
            )
            assert second.status_code == 200, second.text
            assert plan_fields(second.headers["x-ownerserve-plan"])["d"] != owner
            assert second.json()["choices"][0]["message"]["content"]
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_retries_total", worker=owner) == 1


async def test_client_disconnect_cancels_generation_on_the_worker():
    with emulated_workers(EmulatedWorker("h0", "hybrid", speed=1)) as ws:
        (h0,) = ws
        async with proxy_client(router_settings(ws)) as (client, router):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5000, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for _ in resp.aiter_lines():
                    break  # the client walks away after the first bytes
            await until(
                lambda: (
                    metric_value(h0.metrics(), "vllm:num_requests_running") == 0
                    and router.pool.get("h0").inflight == 0
                ),
                what="h0 and the router both done with the abandoned request",
            )
            # not a completion: far fewer tokens were generated than requested
            generated = metric_value(h0.metrics(), "vllm:generation_tokens_total")
            assert generated < 1000
