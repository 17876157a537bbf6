"""The front doors over real HTTP against `FakeWorker`s (real servers that fail on demand):
worker errors and mid-stream deaths reach the client in each route's own shape, a client that
goes away mid-stream cancels the worker's request, and the routes answer the same through the
router's own server and through any ASGI server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from ownerserve.config import settings_from_dict
from router.app import create_app
from router.server import running_app
from tests.e2e.router_cluster import metric_value
from tests.router.fake_worker import FakeWorker
from tests.router.waiting import until

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
MESSAGES = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": MODEL, "input": "hi"}


def app_for(*workers: FakeWorker) -> Any:
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60, "retries": 0},
            "planner": {"policy": "colocated"},
            "models": [{"name": MODEL}, {"name": "bad-for-worker"}],
            "workers": [
                {"id": w.name, "url": w.url, "models": [MODEL, "bad-for-worker"]} for w in workers
            ],
        }
    )
    return create_app(settings)


@contextlib.asynccontextmanager
async def served(*workers: FakeWorker) -> AsyncIterator[httpx.AsyncClient]:
    """The router's own HTTP server in front of `workers` (started here)."""
    for w in workers:
        await w.start()
    try:
        async with (
            running_app(app_for(*workers), "127.0.0.1", 0) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield client
    finally:
        for w in workers:
            await w.stop()


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), orjson.loads(lines["data"])))
    return out


async def test_whole_answers_translate_and_worker_errors_keep_their_status():
    async with served(FakeWorker("w0")) as client:
        msg = await client.post("/v1/messages", json=MESSAGES)
        assert msg.status_code == 200 and "x-ownerserve-plan" in msg.headers
        assert msg.json()["content"] == [{"type": "text", "text": "hello from w0"}]
        assert msg.json()["usage"]["input_tokens"] == 5
        resp = await client.post("/v1/responses", json=RESPONSES)
        assert resp.json()["output"][0]["content"][0]["text"] == "hello from w0"
        refused = await client.post("/v1/messages", json={**MESSAGES, "model": "bad-for-worker"})
        assert refused.status_code == 400
        assert refused.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "worker says no"},
        }
        refused = await client.post("/v1/responses", json={**RESPONSES, "model": "bad-for-worker"})
        assert refused.status_code == 400 and refused.json()["error"]["message"] == "worker says no"


async def test_a_failing_worker_is_an_api_error_in_each_shape():
    async with served(FakeWorker("w0", mode="fail500")) as client:
        msg = await client.post("/v1/messages", json=MESSAGES)
        assert msg.status_code == 502 and msg.json()["error"]["type"] == "api_error"
        resp = await client.post("/v1/responses", json=RESPONSES)
        assert resp.status_code == 502 and resp.json()["error"]["type"] == "upstream_error"


async def test_a_worker_dying_mid_stream_ends_each_stream_with_its_error_event():
    async with served(FakeWorker("w0", mode="die_midstream")) as client:
        msg = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
        seq = events(msg.text)
        assert seq[0][0] == "message_start" and seq[-1][0] == "error"
        assert seq[-1][1]["error"]["type"] == "api_error"
        assert "message_stop" not in [name for name, _ in seq]
        resp = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
        seq = events(resp.text)
        assert seq[0][0] == "response.created" and seq[-1][0] == "response.failed"
        assert seq[-1][1]["response"]["error"]["message"]


async def test_a_client_leaving_mid_stream_cancels_the_workers_request():
    worker = FakeWorker("w0", mode="slow", chunks=40)
    async with served(worker) as client:
        body = {**MESSAGES, "stream": True}
        async with client.stream("POST", "/v1/messages", json=body) as r:
            async for line in r.aiter_lines():
                if "content_block_delta" in line:
                    break
        await until(worker.cancelled.is_set, timeout_s=10)


async def test_the_routes_answer_the_same_under_any_asgi_server():
    worker = await FakeWorker("w0").start()
    app = app_for(worker)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://r") as client,
        ):
            msg = await client.post("/v1/messages", json=MESSAGES)
            assert msg.json()["content"][0]["text"] == "hello from w0"
            seq = events(
                (await client.post("/v1/messages", json={**MESSAGES, "stream": True})).text
            )
            assert [name for name, _ in seq][-2:] == ["message_delta", "message_stop"]
            resp = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
            assert events(resp.text)[-1][0] == "response.completed"
            path = f"/v1/responses/{events(resp.text)[-1][1]['response']['id']}"
            stored = await client.get(path)
            assert stored.status_code == 200 and stored.json()["status"] == "completed"
            deleted = await client.delete(path)
            assert deleted.json() == {"id": path.rsplit("/", 1)[1], "object": "response.deleted",
                                      "deleted": True}  # fmt: skip
            assert (await client.get(path)).status_code == 404
            bad = await client.post("/v1/messages", content=b"{oops")
            assert bad.status_code == 400 and bad.json()["type"] == "error"
            count = await client.post("/v1/messages/count_tokens", json=MESSAGES)
            assert count.status_code == 200 and count.json()["input_tokens"] > 0
            wrong = await client.get("/v1/messages")
            assert wrong.status_code == 405 and wrong.json()["type"] == "error"
    finally:
        await worker.stop()


async def test_every_answered_request_counts_ok_not_as_a_disconnect():
    async with served(FakeWorker("w0", mode="slow", chunks=3)) as client:
        for _ in range(3):
            await client.post("/v1/messages", json=MESSAGES)
            await client.post("/v1/messages", json={**MESSAGES, "stream": True})
            await client.post("/v1/responses", json={**RESPONSES, "stream": True})
        text = (await client.get("/metrics")).text
    ok = metric_value(text, "ownerserve_requests_total", status="ok")
    gone = metric_value(text, "ownerserve_requests_total", status="client_disconnected")
    assert (ok, gone) == (9, 0)
