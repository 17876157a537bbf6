"""Two router replicas sharing one Redis-backed ownership directory in front of the same
emulated engines: a session's turns go to its owner whichever replica serves them, and the
workers' KV events reach the shared directory."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

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


class HeldWrites:
    """The real Redis directory with its writes held until `release` (reads go through): the
    window in which a commit runs beside its answer, made as long as a test needs. Not a
    mock: every call reaches Redis, the writes only later."""

    WRITES = frozenset({"set_session_owner", "claim", "renew", "add_replica", "transfer"})

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.released = asyncio.Event()
        self.held = 0

    def release(self) -> None:
        self.released.set()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in self.WRITES:
            return value

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.held += 1
            await self.released.wait()
            return await value(*args, **kwargs)

        return held


async def test_a_sessions_next_turn_on_the_same_replica_waits_for_its_last_commit(redis_server):
    """A turn's commit is held (`HeldWrites`) after its answer came; the next turn, sent the
    moment the answer came, is planned from that commit once it lands (a continuation on the
    owner, planned from the directory's record of it), not from a directory that does not know
    the session yet."""
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    directory = {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix}
    held = HeldWrites(open_directory(DirectorySettings.model_validate(directory)))
    workers = (EmulatedWorker("h0", "hybrid", speed=50), EmulatedWorker("h1", "hybrid", speed=50))
    with emulated_workers(*workers) as ws:
        settings = router_settings(ws, directory=directory)
        async with proxy_client(settings, directory=held) as (client, router):
            router.pending_commits.wait_s = 60.0  # the release, not the bound, ends the wait
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
            headers = {"x-session-id": "held-writes"}
            first = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert first.status_code == 200
            await until(lambda: held.held > 0, what="the first turn's commit, held")
            assert len(router.pending_commits) == 1
            owner = plan_fields(first.headers["x-ownerserve-plan"])["d"]
            answer = first.json()["choices"][0]["message"]["content"]
            turn2 = [*MESSAGES, {"role": "assistant", "content": answer}]
            turn2.append({"role": "tool", "content": "ok"})
            second = asyncio.create_task(
                client.post(
                    "/v1/chat/completions", json={**body, "messages": turn2}, headers=headers
                )
            )
            await until(lambda: router.leases.open > 0, what="the second turn in the router")
            assert not second.done()  # it waits for the first turn's commit
            held.release()
            resp = await second
            assert resp.status_code == 200
            plan = plan_fields(resp.headers["x-ownerserve-plan"])
            assert plan["d"] == owner and plan["action"] == "decode_continuation", plan
            await settled(router)
