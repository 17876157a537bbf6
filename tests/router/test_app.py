"""The router app over real HTTP: request/response passthrough, both P/D protocols, retries,
mid-stream failures, cancellation, errors, admin API. Workers are `FakeWorker`s (real HTTP
servers that record what they get); plans come from a fixed test policy so each behaviour is
pinned down. The e2e tests drive the real policy against emulated engines."""

from __future__ import annotations

import asyncio
import contextlib
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from ownerserve.config import Settings, settings_from_dict
from planner.explain import parse_plan_header
from planner.policies import Planner
from planner.types import Action, Candidate, CostBreakdown, Plan, Policy, RequestClass
from router.app import create_app
from router.server import running_app
from tests.router.fake_worker import FakeWorker, free_port
from tests.router.waiting import cancel_once_started
from tests.waiting import settled, until

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}]}
ADMIN_AUTH = {"authorization": "Bearer adm"}  # the routers here are given admin_token "adm"


class FixedPolicy:
    """Plans `action` on (p, d) when both are routable; else colocated on any live worker."""

    name = "fixed"

    def __init__(
        self, action: Action, p: str, d: str, src: str | None = None, t_nic: float = 0.0
    ) -> None:
        self.action, self.p, self.d, self.src = action, p, d, src
        self.t_nic = t_nic
        self.requests: list[Any] = []
        self.clusters: list[Any] = []

    def plan(self, request: Any, cluster: Any) -> Plan:
        self.requests.append(request)
        self.clusters.append(cluster)
        live = [w.worker_id for w in cluster.workers]
        if self.p in live and self.d in live:
            cost = CostBreakdown(t_compute=0.01, t_nic=self.t_nic)
            cand = Candidate(self.action, self.p, self.d, cost, self.src)
        else:
            w = live[0]
            cand = Candidate(Action.COLOCATED_PREFILL, w, w, CostBreakdown())
        return Plan("fixed", RequestClass.NEW_LONG_PREFIX, cand)


def fixed_planner(settings: Settings, policy: Policy) -> Planner:
    """The deployment's planner with `policy` as its default."""
    return Planner.from_settings(settings, extra={settings.planner.policy: policy})


@contextlib.asynccontextmanager
async def router_for(
    workers: list[tuple[FakeWorker, str, str]],
    policy: FixedPolicy,
    server: dict[str, Any] | None = None,
    nodes: dict[str, str] | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    data = {
        "server": {"port": 0, "health_interval_s": 60, **(server or {})},
        "models": [{"name": MODEL, "block_size": 4}, {"name": "bad-for-worker"}],
        "workers": [
            {
                "id": w.name,
                "url": w.url if w.port else f"http://127.0.0.1:{free_port()}",
                "role": role,
                "kind": kind,
                "bootstrap_port": 9999,
                "node": (nodes or {}).get(w.name, "node0"),
            }
            for w, role, kind in workers
        ],
    }
    settings = settings_from_dict(data)
    app = create_app(settings, planner=fixed_planner(settings, policy))
    async with (
        running_app(app, "127.0.0.1", 0) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        yield client, app.state.router


@pytest.fixture
async def workers() -> AsyncIterator[list[FakeWorker]]:
    ws = [await FakeWorker(f"w{i}").start() for i in range(2)]
    yield ws
    for w in ws:
        await w.stop()


def _plan_fields(resp: httpx.Response) -> dict[str, str]:
    return parse_plan_header(resp.headers["x-ownerserve-plan"])


async def test_body_and_client_headers_pass_through_unchanged(workers):
    w0, _ = workers
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    raw = (
        b'{"model": "tiny",  "messages": [{"role": "user", "content": "hi"}],'
        b' "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}],'
        b' "tool_choice": "auto", "response_format": {"type": "text"}, "logprobs": true,'
        b' "x_vendor": {"keep": [1, 2.50, "\\u00e9"]}}'
    )
    async with router_for([(w0, "hybrid", "emulator")], policy) as (client, _):
        resp = await client.post(
            "/v1/chat/completions",
            content=raw,
            headers={"x-trace-me": "42", "content-type": "application/json"},
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "hello from w0"
    got = w0.completions()[0]
    assert got.body == raw
    assert got.headers["x-trace-me"] == "42"
    assert _plan_fields(resp)["action"] == "colocated_prefill"


async def test_router_api_key_is_checked_and_not_forwarded(workers):
    w0, _ = workers
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy, {"api_keys": ["k1"]}) as (c, _):
        denied = await c.post("/v1/chat/completions", json=CHAT)
        bad_key = {"authorization": "Bearer x"}
        wrong = await c.post("/v1/chat/completions", json=CHAT, headers=bad_key)
        ok = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer k1"})
        models = await c.get("/v1/models")
    assert denied.status_code == wrong.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    assert ok.status_code == 200
    assert "authorization" not in {k.lower() for k in w0.completions()[0].headers}
    assert models.status_code == 401


async def test_vllm_remote_prefill_sends_prefill_then_decode_with_its_params(workers):
    p, d = workers
    policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50}
    async with router_for([(p, "prefill", "emulator"), (d, "decode", "emulator")], policy) as (
        client,
        router,
    ):
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            text = (await resp.aread()).decode()
        assert _plan_fields(resp)["action"] == "remote_prefill"
        await settled(router)
        match = await router.directory.lookup(
            router.tokenizers.get(MODEL).tokenize_chat(None, CHAT["messages"]).chain
        )
    prefill = p.completions()[0].json
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    decode = d.completions()[0].json
    assert decode["kv_transfer_params"]["remote_engine_id"] == "w0"
    assert decode["max_tokens"] == 50 and decode["stream"] is True
    assert "t3" in text and text.rstrip().endswith("[DONE]")
    assert match.owner == "w1"
    assert any(h.worker == "w0" for h in match.holdings)  # the transient P copy


async def test_sglang_remote_prefill_sends_both_with_one_bootstrap_room(workers):
    p, d = workers
    policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
    async with router_for([(p, "prefill", "sglang"), (d, "decode", "sglang")], policy) as (c, _):
        resp = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    pb, db = p.completions()[0].json, d.completions()[0].json
    assert pb["bootstrap_host"] == db["bootstrap_host"] == "127.0.0.1"
    assert pb["bootstrap_port"] == db["bootstrap_port"] == 9999
    assert pb["bootstrap_room"] == db["bootstrap_room"]
    assert 0 <= db["bootstrap_room"] < 2**63
    assert db["stream"] is True and "t3" in resp.text


async def test_artifact_fetch_asks_the_destination_to_pull_from_the_source(workers):
    src, dst = workers
    policy = FixedPolicy(Action.ARTIFACT_FETCH, "w1", "w1", src="w0")
    async with router_for([(src, "hybrid", "emulator"), (dst, "hybrid", "emulator")], policy) as (
        c,
        _,
    ):
        resp = await c.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    fetch = next(r for r in dst.requests if r.path == "/ownerserve/kv/fetch").json
    assert fetch["source_url"] == src.url and fetch["block_hashes"]
    assert fetch["block_size"] == 4
    assert _plan_fields(resp)["fetched"] == "1"
    assert not src.completions() and dst.completions()


async def test_a_transfer_between_nodes_queues_on_the_senders_nic_until_it_drains(workers):
    p, d = workers
    policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1", t_nic=30.0)
    pair = [(p, "prefill", "emulator"), (d, "decode", "emulator")]
    nodes = {"w0": "n0", "w1": "n1"}
    async with router_for(pair, policy, {"admin_token": "adm"}, nodes) as (c, router):
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        links = (await c.get("/admin/links", headers=ADMIN_AUTH)).json()["nic_backlog_s"]
        # the first plan saw idle NICs; the second saw P's node 30 s behind (less what passed)
        first, second = (
            {w.worker_id: w.nic_backlog_s for w in cl.workers} for cl in policy.clusters
        )
        assert first == {"w0": 0.0, "w1": 0.0}
        assert 29.0 < second["w0"] <= 30.0 and second["w1"] == 0.0
        # two transfers queued one after the other on n0, nothing on the receiving node
        assert set(links) == {"n0"} and 59.0 < links["n0"] <= 60.0
        # drained once the queued time has passed
        assert router.nics.backlog("n0", time.monotonic() + 60.0) == 0.0


async def test_a_failed_hand_over_runs_colocated_on_d_and_takes_its_transfer_back(workers):
    p, d = workers
    p.mode = "fail500"
    policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1", t_nic=30.0)
    pair = [(p, "prefill", "emulator"), (d, "decode", "emulator")]
    async with router_for(pair, policy, nodes={"w0": "n0", "w1": "n1"}) as (c, router):
        resp = await c.post("/v1/chat/completions", json=CHAT)
        metrics = (await c.get("/metrics")).text
        assert resp.status_code == 200
        # planned P/D, ran colocated on w1 with the client's own body
        plan = _plan_fields(resp)
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "w0", "w1")
        assert plan["fallback"] == "colocated" and plan["reason"] == "kv_transfer_failed"
        assert plan["gave_up"] == "kv_transfer_failed:w0"
        assert d.completions()[0].json == CHAT
        assert router.nics.snapshot(time.monotonic()) == {}
        # the commit is the colocated run's: no transient copy recorded on w0
        await settled(router)
        match = await router.directory.lookup(
            router.tokenizers.get(MODEL).tokenize_chat(None, CHAT["messages"]).chain
        )
        assert match.owner == "w1" and all(h.worker != "w0" for h in match.holdings)
        assert router.pool.get("w0").breaker.failures == 1
        assert router.recent_plans[-1].as_dict()["fallback"] == {
            "ran": "colocated",
            "reason": "kv_transfer_failed",
            "gave_up": [{"worker": "w0", "reason": "kv_transfer_failed"}],
        }
    labels = 'fallback="colocated",reason="kv_transfer_failed"'
    assert f"ownerserve_fallbacks_total{{{labels}}} 1.0" in metrics


async def test_a_failed_fetch_takes_its_transfer_back_and_a_good_one_keeps_it(workers):
    src, dst = workers
    policy = FixedPolicy(Action.ARTIFACT_FETCH, "w1", "w1", src="w0", t_nic=30.0)
    pair = [(src, "hybrid", "emulator"), (dst, "hybrid", "emulator")]
    async with router_for(pair, policy, nodes={"w0": "n0", "w1": "n1"}) as (c, router):
        dst.fetch_status = 502
        resp = await c.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200 and _plan_fields(resp)["fetched"] == "0"  # recomputed
        assert _plan_fields(resp)["fallback"] == "colocated"
        assert _plan_fields(resp)["gave_up"] == "kv_transfer_failed:w1"
        assert router.nics.snapshot(time.monotonic()) == {}
        dst.fetch_status = 200
        resp = await c.post("/v1/chat/completions", json=CHAT)
        assert _plan_fields(resp)["fetched"] == "1"
        assert 29.0 < router.nics.backlog("n0", time.monotonic()) <= 30.0  # the source's node


async def _stream_past_a_stall(
    workers: tuple[FakeWorker, FakeWorker], policy: FixedPolicy, bound: str, stalled: FakeWorker
) -> tuple[dict[str, str], str, Any]:
    """A streamed chat through a router of the two hybrid `workers` whose `stalled` one holds
    it past the router's 0.3 s `bound` (a server setting): it is answered whole (elsewhere)
    long before the stall would have ended (30 s or never; a busy machine may add seconds to
    the bound, not tens of them), its plan says it gave up on `stalled` for that bound, and
    `stalled` sees its request cancelled (the router closed the connection). Returns the
    plan's fields, the router's metrics after it, and the router."""
    pair = [(w, "hybrid", "emulator") for w in workers]
    async with router_for(pair, policy, {bound: 0.3}) as (c, router):
        t0 = time.monotonic()
        resp = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        elapsed = time.monotonic() - t0
        metrics = (await c.get("/metrics")).text
        async with asyncio.timeout(10.0):
            await stalled.cancelled.wait()
    assert resp.status_code == 200 and "t3" in resp.text
    assert elapsed < 0.3 + 10.0
    plan = _plan_fields(resp)
    assert plan["gave_up"] == f"{bound.removesuffix('_s')}:{stalled.name}"
    return plan, metrics, router


async def test_a_fetch_past_its_bound_is_abandoned_and_the_prompt_recomputed(workers):
    src, dst = workers
    dst.fetch_delay_s = 30.0
    policy = FixedPolicy(Action.ARTIFACT_FETCH, "w1", "w1", src="w0")
    plan, metrics, _ = await _stream_past_a_stall(workers, policy, "kv_transfer_timeout_s", dst)
    assert (plan["action"], plan["fetched"], plan["fallback"]) == (
        "artifact_fetch",
        "0",
        "colocated",
    )
    assert 'ownerserve_upstream_timeouts_total{hop="kv_transfer",worker="w1"} 1.0' in metrics
    assert dst.completions() and not src.completions()


async def test_no_first_byte_within_its_bound_is_retried_on_another_worker(workers):
    stuck, _ = workers
    stuck.mode = "hang"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    plan, metrics, router = await _stream_past_a_stall(
        workers, policy, "first_byte_timeout_s", stuck
    )
    assert (plan["d"], plan["fallback"], plan["reason"]) == (
        "w1",
        "other_worker",
        "first_byte_timeout",
    )
    assert (
        'ownerserve_fallbacks_total{fallback="other_worker",reason="first_byte_timeout"} 1.0'
        in metrics
    )
    assert router.pool.get("w0").breaker.failures == 1


async def test_5xx_before_first_byte_is_retried_on_another_worker(workers):
    bad, good = workers
    bad.mode = "fail500"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(bad, "hybrid", "emulator"), (good, "hybrid", "emulator")], policy) as (
        c,
        _,
    ):
        resp = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        metrics = (await c.get("/metrics")).text
    assert resp.status_code == 200 and "t3" in resp.text
    assert _plan_fields(resp)["d"] == "w1"
    assert 'ownerserve_retries_total{reason="before_first_byte",worker="w0"} 1.0' in metrics


async def test_dead_worker_before_first_byte_is_retried(workers):
    _, good = workers
    dead = FakeWorker("dead")  # never started: connection refused
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "dead", "dead")
    async with router_for([(dead, "hybrid", "emulator"), (good, "hybrid", "emulator")], policy) as (
        c,
        _,
    ):
        resp = await c.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    assert _plan_fields(resp)["d"] == "w1"


async def test_all_workers_failing_gives_an_openai_error_not_a_hang(workers):
    for w in workers:
        w.mode = "fail500"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w, "hybrid", "emulator") for w in workers], policy) as (c, _):
        resp = await c.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "upstream_error"


async def test_worker_dying_mid_stream_ends_with_error_event_then_done(workers):
    w0, _ = workers
    w0.mode = "die_midstream"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with (
        router_for([(w0, "hybrid", "emulator")], policy) as (c, _),
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
    ):
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][6:])["error"]
    assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
    assert any("t0" in line for line in lines)


async def test_client_disconnect_cancels_the_upstream_request(workers):
    w0, _ = workers
    w0.mode = "hang"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy) as (c, router):
        task = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "stream": True}))
        await cancel_once_started(task, w0)
        assert router.pool.get("w0").inflight == 0


async def test_bad_input_gets_openai_errors(workers):
    w0, _ = workers
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy, {"max_body_bytes": 2000}) as (
        c,
        _,
    ):
        malformed = await c.post("/v1/chat/completions", content=b"{nope")
        bad_field = await c.post("/v1/chat/completions", json={**CHAT, "stream": "yes"})
        unknown = await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
        big = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})

        async def body() -> AsyncIterator[bytes]:
            for part in (b'{"model": "tiny", "prompt": "', b"y" * 3000, b'"}'):
                yield part

        chunked = await c.post("/v1/completions", content=body())
        from_worker = await c.post("/v1/chat/completions", json={**CHAT, "model": "bad-for-worker"})
        no_route = await c.get("/v2/nothing")
    assert malformed.status_code == 400 and malformed.json()["error"]["type"]
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "stream"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert big.status_code == 413 and chunked.status_code == 413
    assert big.json()["error"]["code"] == "payload_too_large"
    assert from_worker.status_code == 400
    assert from_worker.json()["error"]["message"] == "worker says no"
    assert no_route.status_code == 404 and "error" in no_route.json()
    assert not w0.completions() or all(
        r.json["model"] == "bad-for-worker" for r in w0.completions()
    )


@contextlib.asynccontextmanager
async def _admin_router(w0: FakeWorker) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """A router with an admin token (`ADMIN_AUTH` carries it) whose one worker `w0` serves
    everything colocated."""
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy, {"admin_token": "adm"}) as (
        c,
        router,
    ):
        yield c, router


async def test_admin_api_adds_drains_and_removes_workers(workers):
    w0, w1 = workers
    async with _admin_router(w0) as (c, router):
        assert (await c.get("/admin/workers")).status_code == 401
        assert (await c.get("/admin/workers", headers={"x-admin-token": "no"})).status_code == 401
        new = {"id": "w1", "url": w1.url, "role": "decode", "models": [MODEL]}
        added = await c.post("/admin/workers", json=new, headers=ADMIN_AUTH)
        assert added.status_code == 201 and added.json()["healthy"]
        dup = await c.post("/admin/workers", json=new, headers=ADMIN_AUTH)
        assert dup.status_code == 400
        bad = await c.post("/admin/workers", json={"id": "x", "url": "ftp://h"}, headers=ADMIN_AUTH)
        assert bad.status_code == 400
        slash = await c.post("/admin/workers", json={**new, "id": "w/2"}, headers=ADMIN_AUTH)
        assert slash.status_code == 400 and "id" in slash.json()["error"]["message"]
        drained = await c.post("/admin/workers/w0/drain", headers=ADMIN_AUTH)
        assert drained.json()["draining"] is True
        resp = await c.post("/v1/chat/completions", json=CHAT)
        assert _plan_fields(resp)["d"] == "w1"  # w0 is draining
        listed = (await c.get("/admin/workers", headers=ADMIN_AUTH)).json()["workers"]
        assert {w["id"] for w in listed} == {"w0", "w1"}
        plans = (await c.get("/admin/plans", headers=ADMIN_AUTH)).json()["plans"]
        assert plans[-1]["chosen"]["decode_worker"] == "w1" and plans[-1]["fallback"] is None
        assert (await c.delete("/admin/workers/w1", headers=ADMIN_AUTH)).status_code == 200
        assert (await c.delete("/admin/workers/w1", headers=ADMIN_AUTH)).status_code == 404
        assert router.pool.get("w1") is None


async def test_models_health_and_metrics(workers):
    w0, _ = workers
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy) as (c, _):
        await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        models = (await c.get("/v1/models")).json()
        health = (await c.get("/health")).json()
        metrics = (await c.get("/metrics")).text
    assert {m["id"] for m in models["data"]} == {MODEL, "bad-for-worker"}
    assert health["status"] == "ok" and health["directory"]["backend"] == "memory"
    assert 'ownerserve_ttft_seconds_bucket{action="colocated_prefill",le="0.005"}' in metrics
    assert 'ownerserve_plan_actions_total{action="colocated_prefill",policy="fixed"} 1.0' in metrics
    assert 'ownerserve_breaker_state{worker="w0"} 0.0' in metrics


async def test_request_timeout_ends_a_started_stream_with_an_error_event(workers):
    w0, w1 = workers
    w0.mode = "slow"  # its 4 chunks 0.5 s apart: the bound ends it after the second or third
    w1.mode = "hang"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    # long enough for the first chunk to come in time on a busy machine too
    async with router_for([(w0, "hybrid", "emulator")], policy, {"request_timeout_s": 1.2}) as (
        c,
        _,
    ):
        resp = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert "t0" in lines[0] and lines[-1] == "data: [DONE]"
    assert orjson.loads(lines[-2][6:])["error"]["code"] == "upstream_timeout"
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w1", "w1")
    async with router_for([(w1, "hybrid", "emulator")], policy, {"request_timeout_s": 0.3}) as (
        c,
        _,
    ):
        resp = await c.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"


async def test_a_plan_asking_for_a_replica_copies_the_owners_prefix_there(workers):
    owner, spare = workers

    class ReplicatingPolicy(FixedPolicy):
        def plan(self, request: Any, cluster: Any) -> Plan:
            from dataclasses import replace

            return replace(super().plan(request, cluster), add_replica_on="w1")

    policy = ReplicatingPolicy(Action.DECODE_CONTINUATION, "w0", "w0")
    async with router_for(
        [(owner, "hybrid", "emulator"), (spare, "hybrid", "emulator")], policy
    ) as (
        c,
        router,
    ):
        await c.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "hot"})
        await settled(router)  # what the first answer started (a copy would be among it)
        assert not [r for r in spare.requests if r.path == "/ownerserve/kv/fetch"]  # no owner yet
        await c.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "hot"})
        await settled(router)  # the copy and its record
        fetch = next(r for r in spare.requests if r.path == "/ownerserve/kv/fetch").json
        assert fetch["source_url"] == owner.url
        chain = router.tokenizers.get(MODEL).tokenize_chat(None, CHAT["messages"]).chain
        match = await router.directory.lookup(chain)
        assert match.owner == "w0" and match.longest("w1") == len(chain)


async def test_requests_are_still_served_when_the_directory_is_unreachable(workers):
    """A Redis directory (without the resilient wrapper) whose server is not running."""
    from ownerserve.directory.redis import RedisDirectory

    w0, _ = workers
    dead_redis = RedisDirectory.from_url(f"redis://127.0.0.1:{free_port()}/0")
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": w0.url}],
        }
    )
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    app = create_app(settings, directory=dead_redis, planner=fixed_planner(settings, policy))
    async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(url + "/v1/chat/completions", json=CHAT)
        metrics = (await c.get(url + "/metrics")).text
    assert resp.status_code == 200
    assert "ownerserve_directory_lookup_errors_total 1.0" in metrics
    await dead_redis.close()


async def test_framework_errors_are_openai_shaped_too(workers):
    w0, _ = workers
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    async with router_for([(w0, "hybrid", "emulator")], policy) as (c, _):
        wrong_method = await c.delete("/v1/models")
        get_completion = await c.get("/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert get_completion.status_code in (404, 405) and "error" in get_completion.json()


async def test_the_router_sweeps_what_expired_from_the_directory(workers):
    """Leases, replicas and sessions end; the router's periodic sweep purges them (an
    in-process directory would otherwise keep every prompt's blocks for good)."""
    w0, _ = workers
    settings = settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            # long enough to see them recorded first even on a busy machine
            "directory": {"lease_s": 1.0, "session_ttl_s": 1.0, "sweep_interval_s": 0.1},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": w0.url}],
        }
    )
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    app = create_app(settings, planner=fixed_planner(settings, policy))
    async with running_app(app, "127.0.0.1", 0) as url, httpx.AsyncClient(timeout=30) as c:
        router = app.state.router
        resp = await c.post(url + "/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200
        stats = (await router.directory.health()).stats
        assert stats["artifacts"] == 1 and stats["sessions"] == 1

        async def swept() -> bool:
            nonlocal stats
            stats = (await router.directory.health()).stats
            return stats["artifacts"] == 0 and stats["sessions"] == 0

        await until(swept, what="the expired records swept")
        metrics = (await c.get(url + "/metrics")).text
    assert stats["artifacts"] == stats["owned_blocks"] == stats["sessions"] == 0
    assert "ownerserve_directory_swept_total 1.0" in metrics
    assert router._sweeper is None  # stopped with the router


async def test_removing_a_worker_the_directory_cannot_forget_answers_503(workers):
    w0, _ = workers
    async with _admin_router(w0) as (c, router):
        real_drop = router.directory.drop_worker

        async def failing_drop(worker_id: str) -> None:
            raise ConnectionError("directory down")

        router.directory.drop_worker = failing_drop
        failed = await c.delete("/admin/workers/w0", headers=ADMIN_AUTH)
        metrics = (await c.get("/metrics")).text
        router.directory.drop_worker = real_drop
        retried = await c.delete("/admin/workers/w0", headers=ADMIN_AUTH)
    assert failed.status_code == 503
    assert failed.json()["error"]["type"] == "directory_unavailable"
    assert "ownerserve_directory_drop_worker_errors_total 1.0" in metrics
    assert retried.status_code == 200


async def test_in_flight_counts_return_to_zero_after_retried_and_streamed_requests(workers):
    bad, good = workers
    bad.mode = "fail500"
    policy = FixedPolicy(Action.REMOTE_PREFILL, "w0", "w1")
    async with router_for([(bad, "prefill", "vllm"), (good, "decode", "vllm")], policy) as (
        c,
        router,
    ):
        for stream in (False, True):
            body = {**CHAT, "stream": stream}
            resp = await c.post("/v1/chat/completions", json=body, headers={"x-session-id": "s1"})
            assert resp.status_code == 200
        inflight = [(w.inflight, w.inflight_prefill_tokens) for w in router.pool.all()]
        session = router.sessions.get("s1")
    assert inflight == [(0, 0), (0, 0)]
    assert session is not None and session.inflight == 0


async def test_memory_debug_route_is_off_by_default_and_shows_what_grew_when_on(workers):
    w0, _ = workers
    async with _admin_router(w0) as (c, _):
        off = await c.get("/admin/debug/memory", headers=ADMIN_AUTH)
    assert off.status_code == 404 and not tracemalloc.is_tracing()
    policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
    on = {"admin_token": "adm", "debug_memory": True}
    async with router_for([(w0, "hybrid", "emulator")], policy, on) as (c, _):
        assert (await c.get("/admin/debug/memory")).status_code == 401
        untraced = (await c.get("/admin/debug/memory", headers=ADMIN_AUTH)).json()
    assert untraced["pymalloc"]["in_use_mb"] > 0 and untraced["pymalloc"]["arenas"] > 0
    assert "traced_mb" not in untraced
    async with router_for(
        [(w0, "hybrid", "emulator")], policy, {**on, "debug_memory_frames": 4}
    ) as (c, _):
        first = (await c.get("/admin/debug/memory", headers=ADMIN_AUTH)).json()
        kept = [bytearray(1 << 20) for _ in range(4)]  # 4 MiB more on the traced heap
        await c.post("/v1/chat/completions", json=CHAT)
        then = (await c.get("/admin/debug/memory", headers=ADMIN_AUTH, params={"top": 5})).json()
    assert first["baseline"] == "taken now" and "sites" not in first
    assert then["traced_gained_mb"] >= 4
    top = then["sites"][0]
    assert len(kept) == 4 and top["kib_gained"] >= 4096 and "test_app.py:" in top["at"][0]
    assert then["tasks_total"] >= 1
    peers = then["descriptors"]["tcp_by_peer"]
    assert any(p.startswith(f"127.0.0.1:{w0.port} ") for p in peers)  # its pooled connection
    assert any(p.startswith("client of :") for p in peers)  # the test client's
    assert not tracemalloc.is_tracing()  # the router stopped what it started
