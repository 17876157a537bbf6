"""`ownerserve worker sidecar` processes end to end: a source sidecar SIGKILLed mid-transfer
fails the destination's fetch cleanly (502, only whole verified blocks kept); through the router
with emulated workers whose `sidecar_url` points at real sidecars, an artifact fetch moves the
prefix between the sidecars and the shared Redis directory records the destination's replica,
and with the source's sidecar dead the plan falls back to recomputing and the request succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.cluster import (
    EmulatedWorker,
    LoopbackServer,
    ManagedProcess,
    emulated_workers,
    wait_healthy,
)
from ownerserve.config import Settings, settings_from_dict
from ownerserve.directory import HoldKind
from ownerserve.kvstate.heads import head_keys
from ownerserve.ports import free_port
from ownerserve.types import Tier
from tests.conftest import RedisServer
from tests.e2e.router_cluster import FAST_DECODE_PROFILE, MODEL, metric_value, proxy_client
from tests.e2e.test_router_actions import REPO, chat, long_turn
from tests.waiting import settled, until
from workers.sidecar.transports import mooncake_status

pytestmark = pytest.mark.timeout(120)

HEADS = range(2)


@dataclass
class SidecarProcess(LoopbackServer):
    """One `ownerserve worker sidecar` process (its own process group)."""

    worker_id: str
    store_dir: Path
    extra: tuple[str, ...] = ()
    transport: str = "tcp"
    port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None

    def start(self, timeout_s: float = 60.0) -> SidecarProcess:
        cmd = [
            sys.executable, "-m", "ownerserve", "worker", "sidecar",
            "--worker-id", self.worker_id, "--port", str(self.port),
            "--store-dir", str(self.store_dir), "--transport", self.transport, *self.extra,
        ]  # fmt: skip
        self.process = ManagedProcess(f"sidecar {self.worker_id}", cmd).start()
        wait_healthy([(self.process, self.url)], timeout_s=timeout_s)
        return self


@contextlib.contextmanager
def sidecars(*procs: SidecarProcess) -> Iterator[tuple[SidecarProcess, ...]]:
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def payload(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def fetch_body(src: SidecarProcess, chain: list[int]) -> dict[str, Any]:
    """A `POST /ownerserve/kv/fetch` body: every artifact of `chain`'s blocks from `src`."""
    return {
        "source_url": src.url,
        "source_worker": src.worker_id,
        "model": MODEL,
        "block_hashes": chain,
        "token_ids": [],
        "block_size": 16,
    }


async def put_blocks(
    http: httpx.AsyncClient, sidecar: SidecarProcess, chain: list[int], size: int
) -> dict[str, bytes]:
    stored: dict[str, bytes] = {}
    for chunk in chain:
        for key in head_keys(MODEL, chunk, HEADS):
            data = stored[key] = payload(key, size)
            r = await http.put(f"{sidecar.url}/ownerserve/kv/artifacts/{key}", content=data)
            assert r.status_code == 201, r.text
    return stored


# --- the owner's sidecar killed mid-transfer ---------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
async def test_source_sidecar_killed_mid_transfer_is_502_and_nothing_corrupt_is_kept(
    tmp_path: Path, transport: str
) -> None:
    if transport == "mooncake":
        module, reason = mooncake_status()
        if module is None:
            pytest.skip(reason)
    chain = [0x5000 + i for i in range(24)]
    size = 4 << 20  # 24 blocks x 2 heads x 4 MiB = 192 MiB to move
    src = SidecarProcess("src", tmp_path / "src", transport=transport)
    dst = SidecarProcess("dst", tmp_path / "dst", transport=transport)
    with sidecars(src, dst):
        async with httpx.AsyncClient(timeout=60.0) as http:
            stored = await put_blocks(http, src, chain, size)
            body = fetch_body(src, chain)
            fetch = asyncio.create_task(http.post(dst.url + "/ownerserve/kv/fetch", json=body))

            async def arrived() -> int:
                return int((await http.get(dst.url + "/health")).json()["artifacts"])

            deadline = time.monotonic() + 60
            # a few artifacts in: at least one whole block, and (most likely) one half-done
            while await arrived() < 3 and time.monotonic() < deadline and not fetch.done():
                await asyncio.sleep(0.002)
            src.kill()  # the owner's sidecar dies while artifacts are in flight
            r = await fetch
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["type"] == "upstream_error" and "src" in err["message"]

            keys = list(stored)
            present = (
                await http.post(dst.url + "/ownerserve/kv/lookup", json={"keys": keys})
            ).json()["present"]
            assert 0 < sum(present) < len(keys)
            per_block = len(HEADS)
            for i in range(0, len(keys), per_block):
                # a block is there whole or not at all
                assert len(set(present[i : i + per_block])) == 1
            for key, here in zip(keys, present, strict=True):
                if here:  # every kept artifact is whole and verified
                    got = await http.get(f"{dst.url}/ownerserve/kv/artifacts/{key}")
                    assert got.status_code == 200 and got.content == stored[key]
            metrics = (await http.get(dst.url + "/metrics")).text
            assert 'ownerserve_sidecar_fetches_total{result="failed"} 1.0' in metrics
            assert "ownerserve_sidecar_corrupted_artifacts 0.0" in metrics
            # what it counts as fetched is exactly what it kept
            kept = sum(present)
            assert metric_value(metrics, "ownerserve_sidecar_fetched_artifacts_total") == kept
            assert await arrived() == kept


async def test_later_fetches_from_a_mooncake_source_read_its_arena_one_sided(
    tmp_path: Path,
) -> None:
    """Two sidecar processes over Mooncake: the first fetch from a source takes the control path
    and starts watching the source's catalog; later fetches of what it lists read the source's
    arena one-sided (counted as direct), and every artifact arrives intact."""
    module, reason = mooncake_status()
    if module is None:
        pytest.skip(reason)
    src = SidecarProcess("src", tmp_path / "src", transport="mooncake")
    dst = SidecarProcess("dst", tmp_path / "dst", transport="mooncake")
    with sidecars(src, dst):
        async with httpx.AsyncClient(timeout=60.0) as http:

            async def fetch(chain: list[int]) -> float:
                r = await http.post(dst.url + "/ownerserve/kv/fetch", json=fetch_body(src, chain))
                assert r.status_code == 200 and r.json()["blocks"] == len(chain), r.text
                metrics = (await http.get(dst.url + "/metrics")).text
                return metric_value(metrics, "ownerserve_sidecar_direct_fetched_artifacts_total")

            stored: dict[str, bytes] = {}
            # enough chains for ~20 s of tries, each on a chain not fetched yet: the catalog
            # arrives within moments, later on a busy machine
            chains = [[0x7000 + 16 * n + i for i in range(3)] for n in range(40)]
            for chain in chains:
                stored |= await put_blocks(http, src, chain, 64 << 10)
            assert await fetch(chains[0]) == 0  # the control path; watching starts
            direct = 0.0
            for chain in chains[1:]:
                direct = await fetch(chain)
                if direct:
                    break
                await asyncio.sleep(0.5)
            assert direct == 3 * len(HEADS)  # a whole chain, in one fetch
            for key, data in stored.items():
                got = await http.get(f"{dst.url}/ownerserve/kv/artifacts/{key}")
                if got.status_code == 200:
                    assert got.content == data
            metrics = (await http.get(dst.url + "/metrics")).text
            assert "ownerserve_sidecar_corrupted_artifacts 0.0" in metrics


# --- through the router -----------------------------------------------------------------------


def other_repo_turn(question: str) -> list[dict[str, Any]]:
    """A long first turn with another prefix than `long_turn`'s."""
    text = REPO.replace("handler", "worker_task")
    return [{"role": "user", "content": "Other repository:\n" + text + question}]


@pytest.fixture
def cluster(
    tmp_path: Path, redis_server: RedisServer
) -> Iterator[tuple[tuple[EmulatedWorker, ...], SidecarProcess, SidecarProcess, str]]:
    """Emulated h0 (slow decoder) and h1 (fast decoder), each with a real sidecar, sharing a
    Redis directory namespace with the router."""
    prefix = f"sc-{uuid.uuid4().hex[:8]}"
    shared = ("--directory", redis_server.url, "--directory-prefix", prefix)
    s0 = SidecarProcess("h0", tmp_path / "s0", shared)
    s1 = SidecarProcess("h1", tmp_path / "s1", shared)
    slow = EmulatedWorker("h0", "hybrid", speed=20)
    fast = EmulatedWorker("h1", "hybrid", profile=FAST_DECODE_PROFILE, speed=20)
    with sidecars(s0, s1), emulated_workers(slow, fast) as ws:
        yield ws, s0, s1, prefix


def settings_for(cluster: Any, redis: str) -> Settings:
    """The router of the `cluster` fixture's workers and sidecars, on the Redis at `redis`."""
    ws, s0, s1, ns = cluster
    urls = {"h0": s0.url, "h1": s1.url}
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 0.5, "admin_token": "adm"},
            # no price on the duplicated HBM bytes a fetch leaves behind: the fast decoder wins
            "planner": {"policy": "ownerserve", "lambda_hbm": 0.0},
            "directory": {"backend": "redis", "redis_url": redis, "key_prefix": ns},
            "models": [{"name": MODEL}],
            "workers": [{**w.worker_settings(), "sidecar_url": urls[w.worker_id]} for w in ws],
        }
    )


async def first_turn_on_h0(
    client: httpx.AsyncClient, router: Any, turn: list[dict[str, Any]]
) -> None:
    """h1 joins later, so the prefix is computed on h0 (and committed to the Redis directory,
    which the router does beside the answer: waited for, as the next turns plan from it)."""
    admin = {"x-admin-token": "adm"}
    assert (await client.post("/admin/workers/h1/drain", headers=admin)).is_success
    plan, _, _ = await chat(client, turn, f"first-{uuid.uuid4().hex[:6]}")
    assert (plan["action"], plan["d"]) == ("colocated_prefill", "h0")
    await settled(router)
    assert (await client.post("/admin/workers/h1/undrain", headers=admin)).is_success


@contextlib.asynccontextmanager
async def routed(
    cluster: Any, redis: RedisServer, first_turn: list[dict[str, Any]]
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, httpx.AsyncClient]]:
    """A client of the router of `cluster` on `redis` (`settings_for`), the router, and a plain
    HTTP client for the sidecars; `first_turn` already served, its prefix computed on h0."""
    async with (
        proxy_client(settings_for(cluster, redis.url)) as (client, router),
        httpx.AsyncClient(timeout=60.0) as http,  # sidecar processes on a busy machine
    ):
        await first_turn_on_h0(client, router, first_turn)
        yield client, router, http


async def test_router_artifact_fetch_moves_the_prefix_between_sidecars_and_records_the_replica(
    cluster: Any, redis_server: RedisServer
) -> None:
    _, s0, s1, _ = cluster
    async with routed(cluster, redis_server, long_turn("Question A?")) as (client, router, http):
        # h0's connector would have saved the prefix's blocks to its sidecar; here the test does
        chain = list(router.tokenizers.get(MODEL).tokenize_chat(None, long_turn("?")).chain)
        await put_blocks(http, s0, chain, 4096)

        plan, text, _ = await chat(client, long_turn("Question B?"), "session-b")
        assert plan["action"] == "artifact_fetch"
        assert (plan["src"], plan["d"], plan["fetched"]) == ("h0", "h1", "1")
        assert text
        moved = (await http.get(s1.url + "/health")).json()
        assert moved["artifacts"] >= 300 * len(HEADS)

        async def sidecar_replica() -> int:
            match = await router.directory.lookup(tuple(chain))
            return max(
                (
                    h.blocks
                    for h in match.holdings
                    if (h.worker, h.tier, h.kind) == ("h1", Tier.CPU, HoldKind.REPLICA)
                ),
                default=0,
            )

        async def replica_published() -> bool:
            return await sidecar_replica() >= 300

        # h1's sidecar publishes its replica to the directory on its own schedule
        await until(replica_published, what="h1's sidecar replica in the directory")
        assert await sidecar_replica() == moved["artifacts"] // len(HEADS)


async def test_router_falls_back_to_recompute_when_the_source_sidecar_is_dead(
    cluster: Any, redis_server: RedisServer
) -> None:
    _, s0, s1, _ = cluster
    async with routed(cluster, redis_server, other_repo_turn("Question C?")) as (client, _, http):
        s0.kill()
        plan, text, usage = await chat(client, other_repo_turn("Question D?"), "session-d")
        assert plan["action"] == "artifact_fetch"
        assert (plan["src"], plan["d"], plan["fetched"]) == ("h0", "h1", "0")
        assert text and usage["completion_tokens"] > 0
        metrics = (await http.get(s1.url + "/metrics")).text
        failed = metric_value(metrics, "ownerserve_sidecar_fetches_total", result="failed")
        assert failed >= 1  # the plan's fetch (and possibly a background replication's)
        assert (await http.get(s1.url + "/health")).json()["artifacts"] == 0
