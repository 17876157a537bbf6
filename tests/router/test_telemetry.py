"""Telemetry over real transports: spans exported by the OTLP/HTTP exporter to a receiver,
W3C trace context on the upstream request, and every metric the Grafana dashboard plots
exported on `/metrics`, the open request leases among them, and the KV a worker without KV
events holds by the leases the router took for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

import httpx

from ownerserve.config import settings_from_dict
from planner.types import Action
from router.app import create_app
from router.server import running_app
from tests.otlp_receiver import OtlpReceiver
from tests.router.fake_worker import FakeWorker
from tests.router.test_app import CHAT, MODEL, FixedPolicy, fixed_planner
from tests.waiting import until

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "ownerserve-router.json"


async def test_spans_reach_an_otlp_receiver_and_trace_context_reaches_the_worker():
    receiver = await OtlpReceiver().start()
    worker = await FakeWorker("w0").start()
    try:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 60},
                "telemetry": {"otlp_endpoint": receiver.url},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": worker.url}],
            }
        )
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        app = create_app(settings, planner=fixed_planner(settings, policy))
        async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient() as client:
            resp = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            await asyncio.to_thread(app.state.router.telemetry._provider.force_flush)
        spans = receiver.spans()
        names = {s.name for s in spans}
        assert {
            "ownerserve.request",
            "ownerserve.tokenize",
            "ownerserve.directory.lookup",
            "ownerserve.plan",
            "ownerserve.upstream",
            "ownerserve.upstream.call",
        } <= names
        traceparent = worker.completions()[0].headers["traceparent"]
        trace_id = traceparent.split("-")[1]
        request_span = next(s for s in spans if s.name == "ownerserve.request")
        assert request_span.trace_id.hex() == trace_id
    finally:
        await worker.stop()
        await receiver.stop()


async def test_every_metric_on_the_dashboard_is_exported():
    worker = await FakeWorker("w0").start()
    try:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 60},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": worker.url}],
            }
        )
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        app = create_app(settings, planner=fixed_planner(settings, policy))
        async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient() as client:
            await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
            exported = (await client.get(url + "/metrics")).text
    finally:
        await worker.stop()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]  # rows have none
    used = {
        re.sub(r"_(bucket|count|sum)$", "", m)
        for e in exprs
        for m in re.findall(r"ownerserve_\w+", e)
    }
    families = {line.split()[2] for line in exported.splitlines() if line.startswith("# TYPE")}
    missing = {m for m in used if m not in families and m.removesuffix("_total") not in families}
    assert not missing, missing


async def test_open_request_leases_are_exported_while_held_and_zero_once_idle():
    worker = await FakeWorker("w0", mode="hang").start()
    try:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 60, "request_timeout_s": 5},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": worker.url}],
            }
        )
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        app = create_app(settings, planner=fixed_planner(settings, policy))
        gauge = "ownerserve_request_leases_open "
        async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient() as client:

            async def leases_open() -> float:
                text = (await client.get(url + "/metrics")).text
                return float(next(x for x in text.splitlines() if x.startswith(gauge)).split()[1])

            assert await leases_open() == 0.0
            held = asyncio.create_task(
                client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
            )
            await until(lambda: worker.completions(), what="the request reached the worker")
            assert await leases_open() == 1.0
            held.cancel()  # the client goes away: the router gives the lease back
            with contextlib.suppress(asyncio.CancelledError):
                await held

            async def idle() -> bool:
                return await leases_open() == 0.0

            await until(idle, what="the lease given back")
    finally:
        await worker.stop()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


async def test_a_worker_without_kv_events_holds_the_blocks_of_its_leases_until_they_expire():
    worker = await FakeWorker("w0").start()
    try:
        settings = settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 0.1},
                "directory": {"lease_s": 1.0},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": worker.url}],
            }
        )
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        app = create_app(settings, planner=fixed_planner(settings, policy))
        labels = {"worker": "w0", "tier": "gpu", "source": "leases"}
        async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient() as client:

            async def metrics() -> str:
                return (await client.get(url + "/metrics")).text

            assert _sample(await metrics(), "ownerserve_kv_blocks", **labels) == 0.0
            resp = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            text = await metrics()
            prompt = _sample(text, "ownerserve_prefix_tokens_total", worker="w0", kind="prompt")
            assert prompt is not None and prompt >= 8
            blocks = prompt // 4  # the prompt's sealed blocks, all claimed by its commit
            assert _sample(text, "ownerserve_kv_blocks", **labels) == blocks
            assert _sample(text, "ownerserve_kv_tokens", **labels) == blocks * 4
            assert _sample(text, "ownerserve_kv_blocks", worker="w0", source="events") is None

            async def expired() -> bool:
                return _sample(await metrics(), "ownerserve_kv_blocks", **labels) == 0.0

            await until(expired, what="the lease's blocks gone once it expired")
    finally:
        await worker.stop()
