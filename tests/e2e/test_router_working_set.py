"""Through the router to emulated engines (real processes): each session's KV is counted in
its decode worker's working set while it is in flight and through a short predicted tool gap
(`planner.workingset`, shown by `/admin/workers`), a placement that pushes other sessions'
working sets out of a worker is priced (`w_disp` in the plan header), and a worker offloading
to a CPU tier is seen as one."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker
from tests.e2e.router_cluster import (
    MODEL,
    plan_fields,
    proxy_client,
    router_settings,
    workers_fixture,
)

pytestmark = pytest.mark.timeout(120)

BLOCKS = 600  # 9,600 tokens of KV per worker: one long session fits, two do not


def prompt(tag: str) -> list[dict[str, Any]]:
    """~6k tokens (byte tokenizer), distinct per tag."""
    body = "".join(f"def {tag}_{i}(x):\n    return x + {i}\n" for i in range(200))
    return [{"role": "user", "content": body + "Explain."}]


SMALL = ("--num-blocks", str(BLOCKS))
workers = workers_fixture(
    lambda: (
        EmulatedWorker("h0", "hybrid", speed=8, extra=SMALL),
        EmulatedWorker("h1", "hybrid", speed=8, extra=(*SMALL, "--cpu-num-blocks", "600")),
    )
)


async def turn(client: httpx.AsyncClient, session: str) -> tuple[dict[str, str], dict[str, Any]]:
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": prompt(session), "max_tokens": 4},
        headers={"x-session-id": session},
    )
    assert resp.status_code == 200, resp.text
    return plan_fields(resp.headers["x-ownerserve-plan"]), resp.json()["usage"]


async def workers_json(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    resp = await client.get("/admin/workers", headers={"x-admin-token": "adm"})
    assert resp.status_code == 200
    return {w["id"]: w for w in resp.json()["workers"]}


async def test_sessions_are_counted_where_their_kv_lives_and_displacement_is_priced(workers):
    settings = router_settings(
        workers, server={"admin_token": "adm"}, planner={"retention_prior_gap_s": 60.0}
    )
    async with proxy_client(settings) as (client, _):
        plan_a, usage_a = await turn(client, "a")
        state = await workers_json(client)
        home = plan_a["d"]
        assert state[home]["working_set_tokens"] == usage_a["total_tokens"]
        other = "h1" if home == "h0" else "h0"
        assert state[other]["working_set_tokens"] == 0
        assert state["h1"]["load"]["offloads"] is True
        assert state["h0"]["load"]["offloads"] is False
        assert "w_disp" not in plan_a  # room everywhere: nothing displaced
        # b goes where it displaces nothing; c then pushes one of them out, and pays for it
        plan_b, _ = await turn(client, "b")
        assert plan_b["d"] == other
        plan_c, _ = await turn(client, "c")
        assert float(plan_c["w_disp"]) > 0
        state = await workers_json(client)
        assert sum(w["working_set_tokens"] for w in state.values()) > 2 * usage_a["total_tokens"]


async def test_a_gap_predicted_long_releases_the_working_set(workers):
    settings = router_settings(
        workers,
        server={"admin_token": "adm"},
        planner={"retention_prior_gap_s": 120.0, "retention_max_gap_s": 60.0},
    )
    async with proxy_client(settings) as (client, _):
        plan, _ = await turn(client, "long-gap")
        state = await workers_json(client)
        assert state[plan["d"]]["working_set_tokens"] == 0
