"""Through the router to real vLLM CPU workers: colocated and remote-prefill (NIXL) requests,
streaming and not, give the same greedy answer; the directory learns from vLLM's own KV events
where a prefix lives and routes the next turn there (vLLM counts the cache hit); a worker killed
mid-stream ends the client's stream cleanly and loses its blocks in the directory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ownerserve.config import Settings
from tests.e2e.router_cluster import plan_fields, proxy_client, sse_chunks
from tests.e2e.vllm.conftest import (
    BLOCK,
    LOGPROB_TOL,
    PDPair,
    until,
    vllm_client,
    vllm_router_settings,
    vllm_worker,
)
from workers.vllm_cpu.model import SERVED_NAME
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def router_settings(
    install: VllmCpuInstall, workers: list[tuple[str, VllmServer]], policy: str
) -> Settings:
    return vllm_router_settings(install, [vllm_worker(wid, s) for wid, s in workers], policy)


def turn(topic: str, n: int = 60) -> list[dict[str, Any]]:
    text = " ".join(f"{topic} step {i}: the agent reads file {i} and calls tool" for i in range(n))
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": text},
    ]


def body(messages: list[dict[str, Any]], stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


async def complete(
    client: httpx.AsyncClient, req: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, str], list[str], list[float]]:
    """One chat call through the router: (plan, token texts, token logprobs)."""
    if not req["stream"]:
        r = await client.post("/v1/chat/completions", json=req, headers=headers)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        plan = plan_fields(r.headers["x-ownerserve-plan"])
        return plan, [c["token"] for c in content], [c["logprob"] for c in content]
    tokens: list[str] = []
    logprobs: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=req, headers=headers) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        plan = plan_fields(r.headers["x-ownerserve-plan"])
        async for chunk in sse_chunks(r):
            for choice in chunk.get("choices") or ():
                for c in (choice.get("logprobs") or {}).get("content") or ():
                    tokens.append(c["token"])
                    logprobs.append(c["logprob"])
    return plan, tokens, logprobs


async def test_remote_prefill_and_colocated_give_the_same_greedy_answer(
    vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer, vllm_pd_pair: PDPair
) -> None:
    pd = router_settings(
        vllm_install, [("p0", vllm_pd_pair.prefill), ("d0", vllm_pd_pair.decode)], "static-pd"
    )
    colo = router_settings(vllm_install, [("h0", vllm_hybrid)], "colocated")
    messages = turn("parity")
    results = {}
    async with proxy_client(pd) as (client, _):
        client.timeout = httpx.Timeout(300.0)
        for stream in (False, True):
            plan, tokens, lps = await complete(client, body(messages, stream), {})
            assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "d0")
            results[("pd", stream)] = (tokens, lps)
    async with proxy_client(colo) as (client, _):
        client.timeout = httpx.Timeout(300.0)
        for stream in (False, True):
            plan, tokens, lps = await complete(client, body(messages, stream), {})
            # the second call may continue the first one's context on h0: still no P/D
            assert plan["action"] in ("colocated_prefill", "decode_continuation"), plan
            assert plan["d"] == "h0"
            results[("colo", stream)] = (tokens, lps)
    ref_tokens, ref_lps = results[("colo", False)]
    assert len(ref_tokens) == 8
    for key, (tokens, lps) in results.items():
        assert tokens == ref_tokens, key
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= LOGPROB_TOL, key


async def test_next_turn_goes_to_the_worker_whose_kv_events_hold_the_prefix(
    vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer, vllm_hybrid_b: VllmServer
) -> None:
    settings = router_settings(
        vllm_install, [("a", vllm_hybrid), ("b", vllm_hybrid_b)], "ownerserve"
    )
    b_direct = vllm_client("b", vllm_hybrid_b.url)
    async with proxy_client(settings) as (client, router):
        client.timeout = httpx.Timeout(300.0)
        tokenizer = router.tokenizers.get(SERVED_NAME)

        async def held_by(worker: str, messages: list[dict[str, Any]], blocks: int) -> bool:
            chain = tokenizer.tokenize_chat(None, messages).chain
            match = await router.directory.lookup(chain)
            return bool(match.longest(worker) >= blocks)

        # The router's KV event subscription is up once a direct request's blocks show up.
        probe = turn("probe", 10)
        await b_direct.post("/v1/chat/completions", body(probe, False, 1))
        try:
            await until(lambda: held_by("b", probe, 1), 30.0)
        except AssertionError:
            await b_direct.post("/v1/chat/completions", body(turn("probe-again", 10), False, 1))
            await until(lambda: held_by("b", turn("probe-again", 10), 1), 30.0)

        # An earlier turn ran on b behind the router's back: only b's KV events say so.
        first = turn("session-prefix")
        chain_len = len(tokenizer.tokenize_chat(None, first).chain)
        assert chain_len >= 20
        await b_direct.post("/v1/chat/completions", body(first, False, 4))
        await until(lambda: held_by("b", first, chain_len), 30.0)
        assert not await held_by("a", first, 1)

        before = await b_direct.load()
        follow_up = [*first, {"role": "assistant", "content": "ok"}]
        follow_up.append({"role": "user", "content": "Now run the tests."})
        plan, tokens, _ = await complete(
            client, body(follow_up, False), {"x-session-id": "vllm-next-turn"}
        )
        after = await b_direct.load()
        assert plan["d"] == "b", plan
        assert tokens
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        assert hits >= (chain_len - 1) * BLOCK
    await b_direct.aclose()


def deprioritize_engines() -> None:
    """Nice 19 for every process in the process groups this process's children lead (each
    server leads its own), except the leaders themselves (the vLLM API servers).

    Each server is pinned to one core, where its engine busy-loops while it generates. At equal
    priority the API server beside it gets too little CPU to send events as tokens come, and
    sends the answer in one burst once the engine is done (measured with one server: first
    event, 4 s of nothing, then 1,500 events at once). With every thread of the engine
    processes at nice 19 the same 1,500 events spread evenly over 4 s. The test process (and
    the in-process router) also gets the CPU whenever it wants it."""
    me = str(os.getpid())
    stats: list[tuple[int, list[str]]] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats.append((int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()))
        except (OSError, ValueError):
            continue
    # fields after the command: state, ppid, pgrp, ...
    groups = {int(f[2]) for _, f in stats if f[1] == me and int(f[2]) != os.getpgrp()}
    for pid, f in stats:
        if int(f[2]) in groups and pid != int(f[2]):
            with contextlib.suppress(OSError):  # a nice value is per thread on Linux
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(task.name), 19)


async def test_worker_killed_mid_stream_ends_the_stream_cleanly_and_loses_its_blocks(
    vllm_install: VllmCpuInstall, vllm_hybrid: VllmServer, vllm_hybrid_b: VllmServer
) -> None:
    """Runs last: it kills one of the package's vLLM servers. Mid-stream migration off: the
    stream is to end with its error event here, not move to the other worker
    (`tests/e2e/test_router_migration.py` has it move)."""
    servers = {"a": vllm_hybrid, "b": vllm_hybrid_b}
    entries = [vllm_worker(wid, s) for wid, s in servers.items()]
    settings = vllm_router_settings(vllm_install, entries, server={"max_migrations": 0})
    messages = turn("doomed", 12)
    async with proxy_client(settings) as (client, router):
        client.timeout = httpx.Timeout(300.0)
        chain = router.tokenizers.get(SERVED_NAME).tokenize_chat(None, messages).chain
        headers = {"x-session-id": "doomed"}
        # first turn: the owner computes the prefix and the directory learns it from its events;
        # the other worker computes it too, directly, so whichever worker the planner picks for
        # the next turn (a loaded box can make the owner look slow) holds blocks to lose
        warm = await client.post(
            "/v1/chat/completions", json=body(messages, False), headers=headers
        )
        assert warm.status_code == 200
        owner = plan_fields(warm.headers["x-ownerserve-plan"])["d"]
        (other,) = set(servers) - {owner}
        direct = vllm_client(other, servers[other].url)
        try:
            await direct.post("/v1/chat/completions", body(messages, False, 1))
        finally:
            await direct.aclose()

        async def both_hold() -> bool:
            match = await router.directory.lookup(chain)
            return all(match.longest(w) > 0 for w in servers)

        await until(both_hold, 30.0)
        # The router answers with headers only once the worker's first bytes arrived, so
        # generation has begun; kill the worker right then, ~1,500 tokens before its end. Twice
        # on CI's 2 cores (and once here in the whole suite) the answer was complete before the
        # kill: an API server starved by its engine sends it in one late burst (see
        # `deprioritize_engines`), so the engines (all of them: the package's P/D pair spins
        # too) run below their API servers and this process from here on.
        deprioritize_engines()
        req = body(messages, True, max_tokens=1500)
        lines: list[str] = []
        victim = ""
        async with client.stream("POST", "/v1/chat/completions", json=req, headers=headers) as r:
            assert r.status_code == 200
            victim = plan_fields(r.headers["x-ownerserve-plan"])["d"]
            servers[victim].kill()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = orjson.loads(lines[-2][6:])
        assert "error" in last, (len(lines), lines[:4], lines[-4:])
        error = last["error"]
        assert error["type"] == "upstream_error"
        assert victim in error["message"]

        async def dropped() -> bool:
            match = await router.directory.lookup(chain)
            return not router.pool.get(victim).healthy and match.longest(victim) == 0

        await until(dropped, 30.0)
        (survivor,) = set(servers) - {victim}  # only the dead worker's blocks are forgotten
        assert (await router.directory.lookup(chain)).longest(survivor) > 0
