"""The KV economics the router exports, against emulated engines (real processes, with a CPU
tier) and the in-process directory: per answered request the prompt's prefix reuse
(`ownerserve_prefix_tokens_total`: its prompt, what the directory held, what the plan
predicted, what the prefill worker reported cached) agrees with the request log and with what
each worker counted itself; the KV each worker holds per tier (`ownerserve_kv_blocks`, from
its KV events) is what the worker's `GET /kv_blocks` shows; and after multi-turn sessions
sharing a prefix over both workers, the HBM duplicate factor the router exports
(`ownerserve_kv_block_copies / ownerserve_kv_blocks_distinct`, from the directory's counts,
in-process and on Redis) and each worker's GPU blocks agree with the workers' own within 5%."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker
from planner.explain import DECISION_TERMS, NOT_BY_COST, ONLY_CANDIDATE
from router.requestlog import REQUEST_LOGGER, parse_logfmt
from tests.e2e.router_cluster import (
    MODEL,
    metric_value,
    plan_fields,
    proxy_client,
    router_settings,
    sse_chunks,
    workers_fixture,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)

CPU_TIER = ("--cpu-num-blocks", "4096")

cluster = workers_fixture(
    lambda: tuple(EmulatedWorker(wid, "hybrid", speed=20, extra=CPU_TIER) for wid in ("h0", "h1"))
)

SYSTEM = {"role": "system", "content": "You are a coding agent working on one repository.\n"}
REPO = "".join(
    f"def handler_{i}(request):\n    return route(request, shard={i})\n" for i in range(30)
)


async def turn(
    client: httpx.AsyncClient,
    session: str,
    messages: list[dict[str, Any]],
    *,
    stream: bool = True,
    policy: str | None = None,
) -> tuple[dict[str, str], dict[str, Any], str]:
    """One chat turn (streamed with its usage chunk, or whole): (its plan, its usage, its
    answer's text)."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 6}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-session-id": session}
    if policy is not None:
        headers["x-ownerserve-policy"] = policy
    if not stream:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        text = answer["choices"][0]["message"]["content"] or ""
        return plan_fields(resp.headers["x-ownerserve-plan"]), answer["usage"], text
    usage: dict[str, Any] = {}
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        plan = plan_fields(resp.headers["x-ownerserve-plan"])
        async for chunk in sse_chunks(resp):
            for choice in chunk.get("choices") or ():
                parts.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return plan, usage, "".join(parts)


def prefix_tokens(text: str, worker: str, kind: str) -> float:
    return metric_value(text, "ownerserve_prefix_tokens_total", worker=worker, kind=kind)


def kv_blocks(text: str, worker: str, tier: str) -> float:
    return metric_value(text, "ownerserve_kv_blocks", worker=worker, tier=tier, source="events")


async def held(workers: Any) -> dict[str, dict[str, Any]]:
    """Each worker's `GET /kv_blocks`."""
    async with httpx.AsyncClient(timeout=10) as http:
        return {w.worker_id: (await http.get(w.url + "/kv_blocks")).json() for w in workers}


async def cold(workers: Any) -> None:
    """Every worker's caches dropped, its CPU tier's too, before a router subscribes to its
    KV events (a router counts what a worker holds from the events it gets: what was stored
    before it subscribed is not among them)."""
    async with httpx.AsyncClient(timeout=10) as http:
        for w in workers:
            resp = await http.post(w.url + "/reset_prefix_cache?reset_external=true")
            assert resp.status_code == 200, resp.text


def engine_hits(workers: Any) -> dict[str, float]:
    """Each worker's own count of prompt tokens found in its prefix cache."""
    return {w.worker_id: metric_value(w.metrics(), "vllm:prefix_cache_hits_total") for w in workers}


async def test_prefix_reuse_agrees_with_the_request_log_and_the_workers_own_cache_hits(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    ids = [w.worker_id for w in cluster]
    settings = router_settings(
        cluster, planner={"policy": "ownerserve", "allow_policy_header": True}
    )
    hits_before = engine_hits(cluster)
    async with proxy_client(settings) as (client, _):
        before = (await client.get("/metrics")).text
        for w in ids:  # every label set is there before the first request
            for kind in ("prompt", "available", "predicted", "delivered", "reported"):
                assert f'kind="{kind}",model="{MODEL}",worker="{w}"' in before
        messages = [SYSTEM, {"role": "user", "content": "Repository:\n" + REPO + "Fix shard 3."}]
        usages: list[dict[str, Any]] = []
        plans: list[dict[str, str]] = []
        for k in range(3):  # a session's turns, each extending the last: reuse grows
            plan, usage, text = await turn(client, "econ-a", messages, stream=k != 1)
            plans.append(plan)
            usages.append(usage)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Now shard {k + 4}, please."},
            ]
        # a remote prefill of a new prompt: P holds none of it, D counts all P sent as cached,
        # and the prefill worker's own answer is what counts as delivered
        fresh = [{"role": "user", "content": "An unrelated question about caching. " * 30}]
        plan, usage, _ = await turn(client, "econ-b", fresh, policy="static-pd")
        assert plan["action"] == "remote_prefill" and plan["p"] != plan["d"]
        plans.append(plan)
        usages.append(usage)

        n = len(plans)
        await until(
            lambda: sum(r.name == REQUEST_LOGGER for r in caplog.records) >= n,
            what="every request's log line",
        )
        logged = [parse_logfmt(r.getMessage()) for r in caplog.records if r.name == REQUEST_LOGGER]
        after = (await client.get("/metrics")).text

    by_p = {w: [line for line in logged if line["prefill"] == w] for w in ids}
    for w in ids:
        assert prefix_tokens(after, w, "prompt") == sum(int(x["prompt_tokens"]) for x in by_p[w])
        assert prefix_tokens(after, w, "predicted") == sum(int(x["reused_tokens"]) for x in by_p[w])
        # every emulated answer reports its cached tokens: reported is the whole prompt
        assert prefix_tokens(after, w, "reported") == prefix_tokens(after, w, "prompt")
    # the router's prompt tokens are the engines' own count of them
    assert sum(prefix_tokens(after, w, "prompt") for w in ids) == sum(
        u["prompt_tokens"] for u in usages
    )
    # the session's later turns found its earlier prompt held: available at least predicted
    session_p = plans[1]["p"]
    assert prefix_tokens(after, session_p, "available") > 0
    for w in ids:
        assert prefix_tokens(after, w, "available") >= prefix_tokens(after, w, "predicted")
    # delivered is each prefill worker's own cache hits (the workers count them too), not the
    # decode side's report of a remote prefill (it counts what P sent as cached)
    hits = engine_hits(cluster)
    for w in ids:
        assert prefix_tokens(after, w, "delivered") == hits[w] - hits_before[w]
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] > 0  # D's report


async def test_kv_held_per_worker_and_tier_is_what_each_worker_shows(cluster: Any) -> None:
    await cold(cluster)
    settings = router_settings(cluster)
    async with proxy_client(settings) as (client, _):
        for i in range(4):  # sessions on both workers, their prompts written through to CPU
            messages = [{"role": "user", "content": f"Session {i}: explain the build. " * 40}]
            await turn(client, f"econ-held-{i}", messages, policy=None)
        shown: dict[str, Any] = {}

        async def agree() -> bool:
            text = (await client.get("/metrics")).text
            shown.update(workers=await held(cluster), text=text)
            return all(
                kv_blocks(text, wid, "gpu") == kv["blocks_held"]
                and kv_blocks(text, wid, "cpu") == kv["cpu_blocks_held"]
                for wid, kv in shown["workers"].items()
            )

        await until(agree, what="the router's KV per worker and tier equal to the workers'")
    text, workers = shown["text"], shown["workers"]
    assert sum(kv["blocks_held"] for kv in workers.values()) > 0
    assert sum(kv["cpu_blocks_held"] for kv in workers.values()) > 0
    for wid, kv in workers.items():
        assert kv_blocks(text, wid, "ssd") == 0
        tokens = metric_value(text, "ownerserve_kv_tokens", worker=wid, tier="gpu", source="events")
        assert tokens == kv["blocks_held"] * kv["block_size"]


AGREE = 0.05
"""How far the router's figures may be from the workers' own (relative)."""


def near(got: float, want: float) -> bool:
    return abs(got - want) <= AGREE * want


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_the_duplicate_factor_and_gpu_blocks_agree_with_the_workers(
    cluster: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    await cold(cluster)
    sections: dict[str, Any] = {"planner": {"policy": "ownerserve", "allow_policy_header": True}}
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = f"econ-{uuid.uuid4().hex[:8]}"
        sections["directory"] = {"backend": "redis", "redis_url": server.url, "key_prefix": prefix}
    settings = router_settings(cluster, **sections)
    shared = {"role": "system", "content": "Shared instructions for every agent.\n" + REPO}
    sessions: dict[str, list[dict[str, Any]]] = {
        f"econ-dup-{backend}-{i}": [shared, {"role": "user", "content": f"Task {i}: fix it."}]
        for i in range(4)
    }
    workers_used: set[str] = set()
    measured: dict[str, Any] = {}
    async with proxy_client(settings) as (client, _):
        for k in range(3):
            for i, (sid, messages) in enumerate(sessions.items()):
                # half the sessions go round the workers turn by turn: the shared prefix and
                # their own earlier turns end up cached on both
                policy = "round-robin" if i % 2 else None
                plan, _, text = await turn(client, sid, messages, policy=policy)
                workers_used.add(plan["p"])
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Turn {k + 1}: and the tests?"},
                ]

        async def agree() -> bool:
            text = (await client.get("/metrics")).text
            shown = await held(cluster)
            union = set().union(*(kv["block_hashes"] for kv in shown.values()))
            measured.update(
                workers_distinct=len(union),
                workers_copies=sum(kv["blocks_held"] for kv in shown.values()),
                router_distinct=metric_value(text, "ownerserve_kv_blocks_distinct", tier="gpu"),
                router_copies=metric_value(text, "ownerserve_kv_block_copies", tier="gpu"),
                per_worker={
                    wid: (kv_blocks(text, wid, "gpu"), kv["blocks_held"])
                    for wid, kv in shown.items()
                },
            )
            m = measured
            if not m["router_distinct"] or not m["workers_distinct"]:
                return False
            m["router_factor"] = m["router_copies"] / m["router_distinct"]
            m["workers_factor"] = m["workers_copies"] / m["workers_distinct"]
            return (
                near(m["router_distinct"], m["workers_distinct"])
                and near(m["router_copies"], m["workers_copies"])
                and near(m["router_factor"], m["workers_factor"])
                and all(near(got, want) for got, want in m["per_worker"].values())
            )

        try:
            await until(agree, what="the router's KV figures within 5% of the workers'")
        finally:
            print(f"\n{backend}: {measured}")
    assert workers_used == {w.worker_id for w in cluster}
    assert measured["workers_factor"] > 1.2  # the shared prefix is on both workers


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Each sample of `name`: (its labels, its value)."""
    out = []
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', head))
        out.append((labels, float(value)))
    return out


async def test_why_plans_went_where_they_did_who_holds_the_kv_and_what_admission_sees(
    cluster: Any,
) -> None:
    # three of an operator's questions, from /metrics alone, against what the router's admin
    # status and its plans' headers say
    await cold(cluster)
    settings = router_settings(
        cluster,
        server={"admin_token": "adm"},
        planner={"policy": "ownerserve", "allow_policy_header": True},
    )
    admin = {"x-admin-token": "adm"}
    decided: list[str] = []
    margins: list[float] = []
    async with proxy_client(settings) as (client, _):
        text = (await client.get("/metrics")).text
        assert samples(text, "ownerserve_admission_high_watermark") == [({}, 0.95)]
        for i, size in enumerate((1, 4, 2)):  # sessions of different sizes
            messages = [SYSTEM, {"role": "user", "content": "Repository:\n" + REPO * size}]
            for k in range(2):
                plan, _, text_ = await turn(client, f"econ-top-{i}", messages)
                decided.append(plan["action"])
                margins += [float(plan["margin"])] if "margin" in plan else []
                messages += [
                    {"role": "assistant", "content": text_},
                    {"role": "user", "content": f"Turn {k + 1}: go on."},
                ]
        # a baseline policy's plans are told apart from the cost model's
        plan, _, _ = await turn(client, "econ-rr", [SYSTEM], policy="round-robin")
        decided.append(plan["action"])
        margins += [float(plan["margin"])] if "margin" in plan else []

        async def top_shown() -> bool:
            metrics = (await client.get("/metrics")).text
            status = (await client.get("/admin/status", headers=admin)).json()
            top = {(s["session"], s["worker"]): float(s["tokens"]) for s in status["top_sessions"]}
            shown = {
                (labels["session"], labels["worker"]): v
                for labels, v in samples(metrics, "ownerserve_session_kv_tokens")
            }
            return bool(top) and shown == top

        await until(top_shown, what="the top sessions on /metrics as the admin status has them")
        metrics = (await client.get("/metrics")).text
        status = (await client.get("/admin/status", headers=admin)).json()
    # the largest session holds the most KV, and says so
    ranked = sorted(samples(metrics, "ownerserve_session_kv_tokens"), key=lambda s: -s[1])
    assert ranked[0][0]["session"] == "econ-top-1"
    # every plan counted once, by class, action and the term its choice turned on
    decisions = samples(metrics, "ownerserve_plan_decisions_total")
    assert sum(v for _, v in decisions) == len(decided)
    by_action: dict[str, float] = {}
    for labels, v in decisions:
        by_action[labels["action"]] = by_action.get(labels["action"], 0) + v
        assert labels["term"] in (*DECISION_TERMS, ONLY_CANDIDATE, NOT_BY_COST), labels
    assert by_action == {a: float(decided.count(a)) for a in set(decided)}
    # the follow-up turns stayed with their KV: the choice turned on compute saved
    assert any(labels["term"] == "compute" for labels, _ in decisions)
    # admission's view of each worker, as the admin status shows it
    for w in status["workers"]:
        a = w["admission"]
        got = samples(metrics, "ownerserve_admission_kv_usage")
        assert ({"worker": w["id"]}, pytest.approx(a["kv_usage"], abs=0.05)) in [
            (labels, v) for labels, v in got
        ]
        closed = metric_value(metrics, "ownerserve_admission_worker_closed", worker=w["id"])
        assert closed == (1.0 if a["closed"] else 0.0)
    assert metric_value(metrics, "ownerserve_admission_cluster_full") == 0.0
    # how close each choice was, and how far off its predicted timings were
    kept = [x for x in margins if x >= 0]
    assert metric_value(metrics, "ownerserve_plan_margin_seconds_count") == len(kept) > 0
    assert metric_value(metrics, "ownerserve_plan_margin_seconds_sum") == pytest.approx(
        sum(kept), rel=1e-3
    )
    for phase in ("ttft", "tpot"):  # every turn streamed its answer, as planned
        count = metric_value(metrics, "ownerserve_prediction_ratio_count", phase=phase)
        ratio = metric_value(metrics, "ownerserve_prediction_ratio_sum", phase=phase) / count
        # the workers run 20x faster than their profile says, less what calibration learnt
        assert count == len(decided) and 0 < ratio < 10, (phase, count, ratio)
