"""Through the router to emulated engines (real processes): the planner plans only KV moves the
workers can execute (`kv_paths`), a draining worker's session moves away with its KV, and a
fetch that brought nothing is reported as what ran (colocated) beside what was planned."""

from __future__ import annotations

from typing import Any

import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers, start_workers
from ownerserve.config import settings_from_dict
from tests.e2e.router_cluster import FAST_DECODE_PROFILE, metric_value, proxy_client
from tests.e2e.test_router_actions import chat, first_session_on_h0, long_turn

pytestmark = pytest.mark.timeout(120)

ADMIN = {"x-admin-token": "adm"}


def settings(workers: tuple[EmulatedWorker, ...], **per_worker: dict[str, Any]) -> Any:
    """Router settings for `workers`, each entry updated with `per_worker[id]` (a None value
    drops the key)."""
    entries = []
    for w in workers:
        entry = w.worker_settings()
        for key, value in per_worker.get(w.worker_id, {}).items():
            if value is None:
                entry.pop(key, None)
            else:
                entry[key] = value
        entries.append(entry)
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5, "admin_token": "adm"},
            "planner": {"policy": "ownerserve"},
            "models": [{"name": workers[0].model}],
            "workers": entries,
        }
    )


def pair() -> tuple[EmulatedWorker, EmulatedWorker]:
    """h0 and a faster decoder h1: a prefix computed on h0 is worth fetching to h1 (as in
    test_router_actions' artifact fetch)."""
    return (
        EmulatedWorker("h0", "hybrid", speed=20),
        EmulatedWorker("h1", "hybrid", profile=FAST_DECODE_PROFILE, speed=20),
    )


async def test_a_worker_without_a_kv_api_is_never_planned_a_fetch() -> None:
    # the same cluster and turns as test_router_actions' artifact fetch (which fetches to h1),
    # but h1 has no KV API: it may still take the session, by computing the prompt
    with emulated_workers(*pair()) as ws:
        cfg = settings(ws, h1={"kv_paths": ["nixl_pd"]})
        async with proxy_client(cfg) as (client, _):
            await first_session_on_h0(client, ADMIN)
            assert (await client.post("/admin/workers/h1/undrain", headers=ADMIN)).is_success
            plan_b, text_b, _ = await chat(client, long_turn("Question B?"), "session-b")
            assert plan_b["action"] not in ("artifact_fetch", "state_migration")
            assert "fetched" not in plan_b
            assert text_b
            fetched = metric_value(
                ws[1].metrics(), "ownerserve_emulator_kv_received_blocks_total", kind="fetch"
            )
            assert fetched == 0


async def test_a_draining_workers_session_moves_away_with_its_kv() -> None:
    with emulated_workers(*pair()) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            first, text_1 = await first_session_on_h0(client, ADMIN)
            assert (await client.post("/admin/workers/h1/undrain", headers=ADMIN)).is_success
            assert (await client.post("/admin/workers/h0/drain", headers=ADMIN)).is_success
            second = [*first, {"role": "assistant", "content": text_1},
                      {"role": "user", "content": "And the next step?"}]  # fmt: skip
            plan_2, text_2, usage_2 = await chat(client, second, "session-a")
            # the session leaves h0 with its KV: h0 serves it while draining
            assert plan_2["action"] in ("state_migration", "artifact_fetch"), plan_2
            assert (plan_2["src"], plan_2["d"], plan_2["fetched"]) == ("h0", "h1", "1")
            got, planned = (int(x) for x in plan_2["fetched_blocks"].split("/"))
            assert got == planned > 300
            assert usage_2["prompt_tokens_details"]["cached_tokens"] >= got * 16
            assert text_2
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_kv_fetches_total", result="full") == 1
            # without its KV API h0's session would have been recomputed: the control
            assert router.pool.get("h0").kv_api


async def test_a_fetch_whose_source_lost_part_of_the_prefix_says_how_much_came() -> None:
    # h0 publishes no KV events to the router (its directory record stays as committed) and
    # has room for about one long prompt: a second one evicts most of the first (its tail)
    h0 = EmulatedWorker("h0", "hybrid", speed=20, extra=("--num-blocks", "520"))
    with emulated_workers(h0, pair()[1]) as ws:
        cfg = settings(ws, h0={"kv_events_endpoint": None})
        async with proxy_client(cfg) as (client, _):
            await first_session_on_h0(client, ADMIN)
            other = [{"role": "user", "content": "Other repository:\n" + "x = 1\n" * 1300}]
            plan_c, _, _ = await chat(client, other, "session-c")
            assert plan_c["d"] == "h0"
            assert (await client.post("/admin/workers/h1/undrain", headers=ADMIN)).is_success
            plan_b, text_b, usage_b = await chat(client, long_turn("Question B?"), "session-b")
            assert (plan_b["action"], plan_b["src"], plan_b["d"]) == ("artifact_fetch", "h0", "h1")
            assert plan_b["fetched"] == "1"
            got, planned = (int(x) for x in plan_b["fetched_blocks"].split("/"))
            assert 0 < got < planned
            # h1 reused what came and computed the rest
            cached = usage_b["prompt_tokens_details"]["cached_tokens"]
            assert got * 16 <= cached < planned * 16
            assert text_b
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_kv_fetches_total", result="partial") == 1


async def test_a_fetch_whose_source_lost_the_prefix_says_it_ran_colocated() -> None:
    h0, h1 = pair()
    with emulated_workers(h0, h1) as ws:
        cfg = settings(ws, h0={"kv_events_endpoint": None})
        # a slow health loop: h0's restart below goes unnoticed, so the directory keeps
        # its record of what h0 held
        cfg = cfg.model_copy(
            update={"server": cfg.server.model_copy(update={"health_interval_s": 60.0})}
        )
        async with proxy_client(cfg) as (client, router):
            await first_session_on_h0(client, ADMIN)
            h0.stop()  # back with an empty cache
            start_workers([h0])
            assert (await client.post("/admin/workers/h1/undrain", headers=ADMIN)).is_success
            plan_b, text_b, usage_b = await chat(client, long_turn("Question B?"), "session-b")
            assert (plan_b["action"], plan_b["src"], plan_b["d"]) == ("artifact_fetch", "h0", "h1")
            # planned a fetch; h0 had nothing to give: h1 computed the prompt itself
            assert plan_b["fetched"] == "0"
            assert plan_b["fetched_blocks"].startswith("0/")
            assert (plan_b["ran"], plan_b["ran_workers"]) == ("colocated_prefill", "h1>h1")
            assert (plan_b["fallback"], plan_b["reason"]) == ("colocated", "kv_fetch_empty")
            assert text_b
            assert usage_b["prompt_tokens_details"]["cached_tokens"] == 0
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "ownerserve_kv_fetches_total", result="empty") == 1
            assert metric_value(metrics, "ownerserve_plan_actions_total",
                                action="colocated_prefill") == 2  # fmt: skip
            assert metric_value(metrics, "ownerserve_fallbacks_total",
                                reason="kv_fetch_empty") == 1  # fmt: skip
            # an empty source is no failure of h0's: its breaker stays closed
            assert router.pool.get("h0").breaker.failures == 0
            last = (await client.get("/admin/plans", headers=ADMIN)).json()["plans"][-1]
            assert (last["action"], last["ran"]["action"]) == (
                "artifact_fetch",
                "colocated_prefill",
            )
            assert last["fetched_blocks"][0] == 0
