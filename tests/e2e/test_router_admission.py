"""Admission end to end (`router.admission`), against a real emulated engine whose KV pool holds
only a few requests: more sessions than fit are held in the router's queue and all complete;
past the queue's bound the answer is 429 with `Retry-After`; a client that gives up while
queued leaves the queue."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from loadgen.cluster import MODEL, EmulatedWorker, emulated_workers
from ownerserve.config import Settings, settings_from_dict
from ownerserve.profiles import PROFILES_DIR
from router.state import Router
from tests.e2e.router_cluster import metric_value, proxy_client
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

BLOCKS = 64
"""The worker's KV pool: 64 blocks of 16 tokens, about three of these requests at once."""
SESSIONS = 10


@pytest.fixture
def small_kv_profile(tmp_path: Path) -> str:
    """fast-test with a small KV pool (the emulator sizes its pool by it, the router its
    working sets) and a decode step slow enough that requests overlap (40 tokens: ~0.4 s)."""
    data = yaml.safe_load((PROFILES_DIR / "fast-test.yaml").read_text())
    data["hbm_kv_bytes"] = BLOCKS * 16 * data["kv_bytes_per_token"]
    data["decode"]["base_s"] = 0.01
    path = tmp_path / "small-kv.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def settings(worker: EmulatedWorker, **admission: Any) -> Settings:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.2},
            "admission": admission,
            "models": [{"name": MODEL}],
            "workers": [worker.worker_settings()],
        }
    )


def chat(session: int, max_tokens: int = 40) -> dict[str, Any]:
    # ~250 tokens (byte tokenizer), different for each session: nothing shared in the cache
    text = f"Session {session}: refactor the module and explain each step. " * 4
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def post(client: httpx.AsyncClient, session: int, **kw: Any) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions", json=chat(session, **kw), headers={"x-session-id": f"s{session}"}
    )


async def peaks(router: Router, worker_id: str, until: asyncio.Future[Any]) -> tuple[int, int]:
    """The longest the admission queue got, and the most requests the router had in flight
    on the worker, while `until` runs."""
    worker = router.pool.get(worker_id)
    assert worker is not None
    queued = inflight = 0
    while not until.done():
        queued = max(queued, router.admission.queued)
        inflight = max(inflight, worker.inflight)
        await asyncio.sleep(0.002)
    return queued, inflight


async def test_sessions_beyond_the_kv_pool_are_held_by_the_router_and_all_complete(
    small_kv_profile: str,
) -> None:
    h0 = EmulatedWorker("h0", "hybrid", profile=small_kv_profile)
    with emulated_workers(h0):
        async with proxy_client(settings(h0)) as (client, router):
            batch = asyncio.gather(*(post(client, i) for i in range(SESSIONS)))
            most_queued, most_inflight = await peaks(router, "h0", batch)
            responses = await batch
            metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [200] * SESSIONS
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in responses)
    assert all('"error"' not in r.text for r in responses)
    assert most_queued > 0  # held in the router's queue, not sent to the engine...
    assert most_inflight < SESSIONS
    assert metric_value(metrics, "ownerserve_admission_admitted_total", path="queued") > 0
    # ... and every one released from it
    assert metric_value(metrics, "ownerserve_admission_queued") == 0
    assert metric_value(metrics, "ownerserve_admission_rejected_total") == 0
    admitted = metric_value(metrics, "ownerserve_admission_admitted_total")
    assert admitted == SESSIONS
    waited = metric_value(metrics, "ownerserve_admission_wait_seconds_count", outcome="admitted")
    assert waited == metric_value(metrics, "ownerserve_admission_admitted_total", path="queued")
    # each session's service is counted: its prompt and its output
    info = router.sessions.get("s0")
    assert info is not None and info.attained_tokens > 40


async def test_with_admission_off_the_same_sessions_all_go_to_the_engine_at_once(
    small_kv_profile: str,
) -> None:
    h0 = EmulatedWorker("h0", "hybrid", profile=small_kv_profile)
    with emulated_workers(h0):
        async with proxy_client(settings(h0, enabled=False)) as (client, router):
            batch = asyncio.gather(*(post(client, i) for i in range(SESSIONS)))
            most_queued, most_inflight = await peaks(router, "h0", batch)
            responses = await batch
            metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [200] * SESSIONS
    assert (most_queued, most_inflight) == (0, SESSIONS)
    assert metric_value(metrics, "ownerserve_admission_admitted_total") == 0


async def test_past_the_queue_bound_the_router_answers_429_with_retry_after(
    small_kv_profile: str,
) -> None:
    h0 = EmulatedWorker("h0", "hybrid", profile=small_kv_profile)
    with emulated_workers(h0):
        s = settings(h0, max_queued=2, retry_after_s=5)
        async with proxy_client(s) as (client, _):
            responses = await asyncio.gather(*(post(client, i) for i in range(SESSIONS)))
            metrics = (await client.get("/metrics")).text
    rejected = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert rejected and served and len(rejected) + len(served) == SESSIONS
    for r in rejected:
        assert r.headers["retry-after"] == "5"
        error = orjson.loads(r.content)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_full")
        assert "queue is full" in error["message"] and error["param"] is None
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in served)
    labels = {"reason": "queue_full"}
    assert metric_value(metrics, "ownerserve_admission_rejected_total", **labels) == len(rejected)
    assert metric_value(metrics, "ownerserve_requests_total", status="429") == len(rejected)
    assert metric_value(metrics, "ownerserve_admission_admitted_total") == len(served)


async def test_a_client_that_gives_up_while_queued_leaves_the_queue(
    small_kv_profile: str,
) -> None:
    h0 = EmulatedWorker("h0", "hybrid", profile=small_kv_profile)
    with emulated_workers(h0):
        async with proxy_client(settings(h0)) as (client, router):
            # long answers (~3 s each): more than the pool holds
            long = [asyncio.create_task(post(client, i, max_tokens=300)) for i in range(6)]
            await until(lambda: router.admission.queued, what="a request in the queue")
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/v1/chat/completions",
                    json=chat(99),
                    headers={"x-session-id": "s99"},
                    timeout=0.3,
                )
            responses = await asyncio.gather(*long)
            gone = {"reason": "client_disconnected"}
            metrics = ""

            async def abandoned() -> bool:  # the router notices the closed connection
                nonlocal metrics
                metrics = (await client.get("/metrics")).text
                return bool(metric_value(metrics, "ownerserve_admission_abandoned_total", **gone))

            await until(abandoned, what="the abandoned request counted")
            queued = router.admission.queued
    assert [r.status_code for r in responses] == [200] * 6
    assert metric_value(metrics, "ownerserve_admission_abandoned_total", **gone) == 1
    assert (
        metric_value(
            metrics, "ownerserve_admission_wait_seconds_count", outcome="client_disconnected"
        )
        == 1
    )
    assert queued == 0
    assert metric_value(metrics, "ownerserve_requests_total", status="client_disconnected") == 1
