"""Two router replicas sharing one Redis-backed ownership directory in front of the same
emulated engines: a session's turns go to its owner whichever replica serves them, and the
workers' KV events reach the shared directory."""

from __future__ import annotations

import uuid

import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import DirectorySettings
from ownerserve.directory import open_directory
from ownerserve.directory.base import HoldKind
from tests.e2e.router_cluster import (
    MODEL,
    plan_fields,
    proxy_client,
    router_settings,
)
from tests.waiting import settled, until

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis]

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read src/router.py and explain the retry logic. " * 12},
]


async def test_two_router_replicas_share_ownership_through_redis(redis_server):
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    directory = {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}
    workers = (EmulatedWorker("h0", "hybrid", speed=50), EmulatedWorker("h1", "hybrid", speed=50))
    with emulated_workers(*workers) as ws:
        settings = router_settings(ws, directory=directory)
        async with proxy_client(settings) as (a, router_a), proxy_client(settings) as (b, router_b):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
            headers = {"x-session-id": "shared-session"}
            first = await a.post("/v1/chat/completions", json=body, headers=headers)
            assert first.status_code == 200
            owner = plan_fields(first.headers["x-ownerserve-plan"])["d"]
            answer = first.json()["choices"][0]["message"]["content"]
            # with Redis the commit runs beside the answer: the next turn, on the other
            # replica, is planned from the directory once it has landed
            await settled(router_a)

            turn2 = [*MESSAGES, {"role": "assistant", "content": answer}]
            turn2.append({"role": "tool", "content": "ok"})
            second = await b.post(
                "/v1/chat/completions", json={**body, "messages": turn2}, headers=headers
            )
            assert second.status_code == 200
            plan = plan_fields(second.headers["x-ownerserve-plan"])
            assert plan["d"] == owner and plan["action"] == "decode_continuation"
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= first.json()["usage"]["prompt_tokens"] - 16
            await settled(router_b)  # b's commit of the second turn

            # an independent client of the same Redis sees the owner and the session
            chain = router_a.tokenizers.get(MODEL).tokenize_chat(None, turn2).chain
            observer = open_directory(DirectorySettings.model_validate(directory))
            try:
                match = await observer.lookup(chain, "shared-session")
                assert match.owner == owner and match.session_owner == owner
                assert match.owner_blocks == len(chain)
                # the owner's KV events reached the directory too (a CACHED holding)

                async def cached_there() -> bool:
                    match = await observer.lookup(chain)
                    return (owner, HoldKind.CACHED) in {(h.worker, h.kind) for h in match.holdings}

                await until(cached_there, what="the owner's KV events in the directory")
            finally:
                await observer.close()
