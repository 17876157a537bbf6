"""The KV paths of real vLLM workers through the router with their KV in Mooncake Store: a real
`mooncake_master`, two sidecars on it (`--store`), and two vLLM servers whose OwnerServe
connector saves and loads through the store itself (`kv_connector_extra_config.store`,
`workers/vllm_connector/store_path.py`) and reports what it put to its sidecar.

- state migration and artifact fetch: B's sidecar reads A's artifacts out of the store
  (`POST /ownerserve/kv/fetch` on a store reads, never a peer's transfer server), B's vLLM
  loads them and computes only what the plan said;
- cold resume: a session evicted from A's vLLM cache comes back from the store;
- an object corrupted in the store (bytes without their digest, written by another client)
  or gone from it: the read stops there, that block and what follows are recomputed with the
  same tokens, and a fetch's plan header says how many blocks came;
- the master killed: a fetch fails at once (the plan header reports the fallback), the turn is
  recomputed with the same tokens, nothing hangs; the master restarted, saves are taken again.

Answers are compared with the same prompt computed whole (a cache salt of its own), as in
`test_router_kv_paths.py`, whose helpers these tests share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ownerserve.ports import free_port
from tests.e2e.vllm.conftest import (
    BLOCK,
    HYBRID_KV_BLOCKS,
    Sidecar,
    _server,
    _start,
    present,
    sidecar_http,
    start_sidecar,
    tokens_by_source,
    until,
)
from tests.e2e.vllm.test_router_kv_paths import (
    Prompt,
    Worker,
    _resume_after_eviction,
    ab_router,
    assert_same_answer,
    chat,
    computed_whole,
    drain,
    fetch_stops_at_a_bad_artifact,
    kv_router,
    migrates_from_draining_a,
    prefix_on_a,
    prompt_of,
    turn,
)
from workers.mooncake_store import (
    ClientSettings,
    MasterUnavailable,
    MooncakeMaster,
    StoreClient,
)
from workers.vllm_cpu.server import VllmServer
from workers.vllm_cpu.setup import VllmCpuInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# Each sidecar mounts this much of its memory into the store; the connectors mount none, so
# every object lands in a sidecar's segment and outlives a vLLM restart.
SEGMENT = "256M"
# Registered staging of each connector, per direction: a 2048-token request's whole KV is some
# 4 MB for the tiny model.
STAGING_BYTES = 32 << 20


@pytest.fixture(scope="module")
def store_master(vllm_work_dir: Path) -> Iterator[MooncakeMaster]:
    try:
        # a client whose heartbeat lapses past the TTL loses its segment and every object in
        # it: 2 s (what tests of a killed client use) lapsed once for a sidecar on a 2-core
        # machine at load 20, mid-test; these tests kill no client
        master = MooncakeMaster(client_ttl_s=30, log_path=vllm_work_dir / "store-master.log")
        master.start()
    except MasterUnavailable as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc}")
    yield master
    master.stop()


@pytest.fixture(scope="module")
def store_workers(
    vllm_install: VllmCpuInstall, vllm_work_dir: Path, store_master: MooncakeMaster
) -> Iterator[tuple[Worker, Worker]]:
    """Workers "a" and "b" on the store: each a sidecar on it and a vLLM whose connector saves
    and loads through it, a small KV cache (evictions), KV events published."""
    work = vllm_work_dir / "store"
    work.mkdir(exist_ok=True)
    url = store_master.address.url
    sidecars: list[Sidecar] = []
    servers: list[VllmServer] = []
    try:
        for worker_id in ("a", "b"):
            sidecars.append(
                start_sidecar(worker_id, work, ("--store", url, "--store-segment-bytes", SEGMENT))
            )
        for cpu, (worker_id, sidecar) in enumerate(zip(("a", "b"), sidecars, strict=True)):
            servers.append(
                _server(
                    vllm_install,
                    work,
                    name=f"store-{worker_id}",
                    kv_events_endpoint=f"ipc://{work}/store-{worker_id}-kv-events.sock",
                    kv_events_replay_port=free_port(),
                    cpu=cpu,
                    extra_args=("--num-gpu-blocks-override", str(HYBRID_KV_BLOCKS)),
                    sidecar_url=sidecar.url,
                    connector_extra=(("store", url), ("store_staging_bytes", STAGING_BYTES)),
                )
            )
        _start(servers)
        yield Worker("a", servers[0], sidecars[0]), Worker("b", servers[1], sidecars[1])
    finally:
        for server in servers:
            server.stop()
        for sidecar in sidecars:
            sidecar.stop()


def connector_log(server: VllmServer) -> str:
    return server.log_path.read_text(errors="replace")


async def on_the_store(http: httpx.AsyncClient, sidecar: Sidecar, master: MooncakeMaster) -> None:
    """`sidecar` keeps its artifacts in `master`'s store."""
    health = (await http.get(f"{sidecar.url}/health")).json()
    assert health["store"] == master.address.url, health


def tamper(master: MooncakeMaster, *, corrupt: str | None = None, drop: str | None = None) -> None:
    """Another store client replaces `corrupt`'s object with bytes that have no digest and
    removes `drop`'s."""
    other = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
    try:
        if corrupt is not None:
            assert other.remove([corrupt]) == [True]
            assert other.put_raw(corrupt, b"not the artifact") == 0
        if drop is not None:
            assert other.remove([drop]) == [True]
    finally:
        other.close()


async def test_a_session_migrates_from_draining_a_to_b_through_the_store(
    vllm_install: VllmCpuInstall,
    store_workers: tuple[Worker, Worker],
    store_master: MooncakeMaster,
) -> None:
    async with sidecar_http() as http:
        for worker in store_workers:
            await on_the_store(http, worker.sidecar, store_master)
    await migrates_from_draining_a(vllm_install, store_workers, "stored session", "s-migrate")
    # the connector put the first turn's blocks into the store itself and reported them
    assert "KV through Mooncake Store" in connector_log(store_workers[0].server)


async def test_a_session_evicted_from_vllm_resumes_from_the_store_with_the_same_tokens(
    vllm_install: VllmCpuInstall, store_workers: tuple[Worker, Worker]
) -> None:
    a = store_workers[0]
    async with kv_router(vllm_install, [a]) as (client, router), sidecar_http() as http:
        resident, prompt, used, answer, _ = await _resume_after_eviction(
            client, router, http, a.server, a.sidecar, "store cold resume"
        )
        assert used["local_cache_hit"] == 0
        assert used["external_kv_transfer"] >= resident.loadable * BLOCK
        assert used["local_compute"] == len(prompt.token_ids) - used["external_kv_transfer"]
        print(f"\nstore cold resume: {len(prompt.token_ids)} prompt tokens, {used}")
        assert_same_answer(answer, await computed_whole(a.server, prompt.messages, "s-resume"))


async def test_an_object_corrupted_or_gone_from_the_store_is_recomputed_with_the_same_tokens(
    vllm_install: VllmCpuInstall,
    store_workers: tuple[Worker, Worker],
    store_master: MooncakeMaster,
) -> None:
    bad_block, gone_block = 7, 9

    async def spoil(_: Worker, prompt: Prompt) -> None:
        bad, gone = prompt.key(bad_block, 1), prompt.key(gone_block, 0)
        await asyncio.to_thread(tamper, store_master, corrupt=bad, drop=gone)

    # the read stops at the corrupted object; B's save puts it back whole (a corrupted
    # object read is also removed from the store)
    await fetch_stops_at_a_bad_artifact(
        vllm_install, store_workers, "store corrupted source", "s-corrupt", spoil, bad_block
    )


async def test_the_master_killed_falls_back_to_recompute_and_restarted_takes_saves_again(
    vllm_install: VllmCpuInstall,
    store_workers: tuple[Worker, Worker],
    store_master: MooncakeMaster,
) -> None:
    async with ab_router(vllm_install, store_workers) as (a, b, client, router, http, b_direct):
        prompt = await prefix_on_a(client, router, http, a, "store master killed")
        store_master.kill()
        try:
            await drain(client, "b", False)
            await drain(client, "a")
            before = await b_direct.load()
            plan, tokens, lps = await chat(client, prompt.messages, "store-killed-second")
            used = tokens_by_source(before, await b_direct.load())
        finally:
            store_master.start()  # same ports: the clients mount their segments again
        # the fetch failed at once: B computed the whole prompt and the header says why
        assert plan["d"] == "b", plan
        assert plan.get("fetched") != "1", plan
        assert "fallback" in plan, plan
        assert used["external_kv_transfer"] == 0
        assert used["local_compute"] == len(prompt.token_ids)
        print(f"\nstore master killed: {len(prompt.token_ids)} prompt tokens, {used}, {plan}")
        assert_same_answer(
            (tokens, lps), await computed_whole(b.server, prompt.messages, "s-killed")
        )

        # restarted: once the sidecars have mounted their segments on it again (the first
        # saves after the restart find no room), a new prompt's blocks are put and reported
        sent: list[list[str]] = []

        async def a_save_taken() -> bool:
            fresh = turn(f"store after the restart {len(sent)}", 40)
            plan, _, _ = await chat(client, fresh, f"store-restarted-{len(sent)}")
            assert plan["d"] == "b", plan
            sent.append(prompt_of(router, fresh).keys)
            held = [all(await present(http, b.sidecar, keys)) for keys in sent]
            return any(held)

        await until(a_save_taken, timeout_s=120.0, poll_s=1.0)
        print(f"store master restarted: saves taken again after {len(sent)} new prompts")
