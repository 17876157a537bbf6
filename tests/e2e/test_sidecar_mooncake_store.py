"""Sidecar processes on Mooncake Store (`--store mooncake://...`) with a real `mooncake_master`:
an artifact one sidecar put is fetched by the other byte for byte (its store client reads what
the first put); a corrupted or vanished object reads as missing and is dropped; the master
killed fails puts, gets and fetches at once with a clear error (nothing hangs) and, restarted,
takes puts again; a sidecar process killed takes its segment, and so its artifacts, with it:
another sidecar's fetch reads them as missing, and the survivor that had fetched them stops
holding them and withdraws them from the directory without anyone reading them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.chaos.probe import DirectoryProbe
from ownerserve.config import DirectorySettings
from ownerserve.directory import HoldKind, open_directory
from ownerserve.kvstate.heads import head_keys
from tests.conftest import RedisServer
from tests.e2e.router_cluster import MODEL, metric_value
from tests.e2e.test_sidecar import SidecarProcess, fetch_body, put_blocks
from tests.waiting import until
from workers.mooncake_store import (
    ClientSettings,
    MasterUnavailable,
    MooncakeMaster,
    StoreClient,
)

pytestmark = pytest.mark.timeout(180)

HEADS = range(2)
KV = "/ownerserve/kv"


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    try:
        m = MooncakeMaster(client_ttl_s=2, log_path=tmp_path / "master.log").start()
    except MasterUnavailable as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc}")
    try:
        yield m
    finally:
        m.stop()


def on_store(
    tmp_path: Path, worker_id: str, master: MooncakeMaster, extra: tuple[str, ...] = ()
) -> SidecarProcess:
    return SidecarProcess(
        worker_id,
        tmp_path / worker_id,
        extra=("--store", master.address.url, "--store-segment-bytes", "64M", *extra),
    )


@contextlib.contextmanager
def two_sidecars(tmp_path: Path, master: MooncakeMaster) -> Iterator[tuple[SidecarProcess, ...]]:
    a, b = on_store(tmp_path, "w0", master), on_store(tmp_path, "w1", master)
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


async def test_artifact_put_by_one_sidecar_is_fetched_by_the_other_byte_for_byte(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    chain = [0x7100 + i for i in range(3)]
    with two_sidecars(tmp_path, master) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http:
            health = (await http.get(f"{b.url}/health")).json()
            assert health["store"] == master.address.url
            stored = await put_blocks(http, a, chain, 70_000)
            r = await http.put(f"{a.url}{KV}/artifacts/{next(iter(stored))}", content=b"x")
            assert r.status_code == 201 and r.json()["tier"] == "mooncake_store"
            stored[next(iter(stored))] = b"x"  # a new value replaces the old one
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.status_code == 200, r.text
            assert r.json() == {
                "blocks": 3,
                "artifacts": 6,
                "bytes": sum(len(v) for v in stored.values()),
            }
            for key, data in stored.items():
                got = await http.get(f"{b.url}{KV}/artifacts/{key}")
                assert got.status_code == 200 and got.content == data
            present = await http.post(f"{b.url}{KV}/lookup", json={"keys": list(stored)})
            assert present.json()["present"] == [True] * 6
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.json() == {"blocks": 3, "artifacts": 0, "bytes": 0}  # held already


async def test_corrupted_or_vanished_artifact_reads_as_missing_and_is_dropped(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    chain = [0x7200 + i for i in range(4)]
    with two_sidecars(tmp_path, master) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http:
            await put_blocks(http, a, chain, 4096)
            bad = head_keys(MODEL, chain[2], HEADS)[1]
            gone = head_keys(MODEL, chain[3], HEADS)[0]
            other = await asyncio.to_thread(
                StoreClient.open, ClientSettings(master.address, segment_bytes=0)
            )
            try:  # another writer leaves bytes without their digest; another removes one
                assert other.remove([bad, gone]) == [True, True]
                assert other.put_raw(bad, b"not the artifact") == 0
            finally:
                other.close()
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.status_code == 200, r.text
            assert r.json()["blocks"] == 2  # the prefix stops before the corrupted block
            for key in (bad, gone):
                assert (await http.get(f"{b.url}{KV}/artifacts/{key}")).status_code == 404
                r = await http.get(f"{a.url}{KV}/artifacts/{key}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "artifact_not_found"
            present = await http.post(f"{a.url}{KV}/lookup", json={"keys": [bad, gone]})
            assert present.json()["present"] == [False, False]  # the source dropped them too
            index = await http.post(
                f"{a.url}{KV}/index", json={"model": MODEL, "chunk_hashes": chain}
            )
            listed = index.json()["keys"]  # blocks put without a declared count: one is whole
            assert [len(ks) for ks in listed] == [2, 2, 1, 1]
            assert bad not in listed[2] and gone not in listed[3]


async def test_master_killed_fails_fast_and_restarted_takes_puts_again(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    chain = [0x7300]
    with two_sidecars(tmp_path, master) as (a, b):
        async with httpx.AsyncClient(timeout=60) as http:
            stored = await put_blocks(http, a, chain, 4096)
            key = next(iter(stored))
            master.kill()
            r = await http.put(f"{a.url}{KV}/artifacts/{key}-2", content=b"y" * 100)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "kv_store_unavailable"
            r = await http.get(f"{a.url}{KV}/artifacts/{key}")
            assert r.status_code == 503 and "Mooncake" in r.json()["error"]["message"]
            # the router's fetch: a 502 with the blocks held (none), then it recomputes
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.status_code == 502, r.text
            assert r.json()["blocks"] == 0 and r.json()["error"]["code"] == "kv_fetch_failed"

            master.start()  # same ports: the clients mount their segments again

            async def put_taken() -> bool:
                r = await http.put(f"{a.url}{KV}/artifacts/{key}", content=stored[key])
                return r.status_code == 201

            await until(put_taken, timeout_s=60, poll_s=0.1, what="a put after the restart")
            other = head_keys(MODEL, chain[0], HEADS)[1]
            r = await http.put(f"{a.url}{KV}/artifacts/{other}", content=stored[other])
            assert r.status_code == 201
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.status_code == 200 and r.json()["blocks"] == 1, r.text


async def test_sidecar_killed_its_segment_and_artifacts_read_as_missing(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    chain = [0x7400, 0x7401]
    with two_sidecars(tmp_path, master) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http:
            stored = await put_blocks(http, a, chain, 8192)
            r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
            assert r.json()["blocks"] == 2
            a.kill()  # SIGKILL: the objects lived in its segment
            for key in stored:
                r = await http.get(f"{b.url}{KV}/artifacts/{key}")
                assert r.status_code == 404, r.text
            present = await http.post(f"{b.url}{KV}/lookup", json={"keys": list(stored)})
            assert present.json()["present"] == [False] * len(stored)


async def test_objects_a_restarted_master_lost_leave_the_directory_within_a_ttl(
    tmp_path: Path, master: MooncakeMaster, redis_server: RedisServer
) -> None:
    chain = [0x7500, 0x7501]
    ttl_s = 3.0
    shared = ("--directory", redis_server.url, "--directory-prefix", "lost")
    a = SidecarProcess(
        "w0",
        tmp_path / "w0",
        extra=(
            "--store", master.address.url, "--store-segment-bytes", "64M",
            "--replica-ttl-s", f"{ttl_s:g}", *shared,
        ),
    )  # fmt: skip
    probe = DirectoryProbe(redis_server.url, "lost")
    try:
        with contextlib.ExitStack() as stack:
            a.start()
            stack.callback(a.stop)
            async with httpx.AsyncClient(timeout=60) as http:
                await put_blocks(http, a, chain, 4096)

                async def named() -> list[int]:
                    return await probe.replica_blocks("w0", tiers=("cpu",), limit=None)

                await until(lambda: _same(named(), chain), what="the replicas published")
                master.kill()
                master.start()  # same ports: the objects it held are gone
                # a renewal no longer names what the store lost: the lines expire in one TTL
                await until(lambda: _same(named(), []), timeout_s=4 * ttl_s, poll_s=0.1,
                            what="the lost objects' replicas gone")  # fmt: skip
                assert (await http.get(f"{a.url}/health")).json()["artifacts"] == 0
                await put_blocks(http, a, chain[:1], 4096)  # what is put again is named again
                await until(lambda: _same(named(), chain[:1]), what="a new put published")
    finally:
        await probe.close()


async def _same(got: Awaitable[list[int]], want: list[int]) -> bool:
    return sorted(await got) == sorted(want)


async def test_sidecar_killed_the_survivor_withdraws_its_artifacts_from_the_directory_unread(
    tmp_path: Path, master: MooncakeMaster, redis_server: RedisServer
) -> None:
    chain = [0x7500, 0x7501]
    prefix = f"mcs-{uuid.uuid4().hex[:8]}"
    shared = ("--directory", redis_server.url, "--directory-prefix", prefix, "--replica-ttl-s", "3")
    a, b, c = (on_store(tmp_path, w, master, shared) for w in ("w0", "w1", "w2"))
    directory = open_directory(
        DirectorySettings(backend="redis", redis_url=redis_server.url, key_prefix=prefix),
        resilient=False,
    )

    async def replicas() -> dict[str, int]:
        match = await directory.lookup(tuple(chain))
        return {h.worker: h.blocks for h in match.holdings if h.kind is HoldKind.REPLICA}

    try:
        with contextlib.ExitStack() as stack:
            for s in (a, b, c):
                s.start()
                stack.callback(s.stop)
            async with httpx.AsyncClient(timeout=30) as http:
                stored = await put_blocks(http, a, chain, 8192)
                r = await http.post(f"{b.url}{KV}/fetch", json=fetch_body(a, chain))
                assert r.json()["blocks"] == 2  # b holds them now: the same objects, a's segment

                async def both_published() -> bool:
                    return await replicas() == {"w0": 2, "w1": 2}

                await until(both_published, what="w0's and w1's replicas in the directory")
                a.kill()  # SIGKILL: the objects lived in its segment

                # another worker's fetch from the survivor reads them as missing (the router
                # then recomputes: `kv_fetch_empty`), never hangs nor takes other bytes
                r = await http.post(f"{c.url}{KV}/fetch", json=fetch_body(b, chain))
                assert r.status_code == 200, r.text
                assert r.json() == {"blocks": 0, "artifacts": 0, "bytes": 0}

                async def none_named() -> bool:
                    return await replicas() == {}

                # nobody reads them on w1: the master drops a's objects after its client TTL
                # (2 s), w1's audit finds them gone and its renewal withdraws them; w0's own
                # replicas expire unrenewed (3 s)
                await until(none_named, timeout_s=60, poll_s=0.1, what="no replica of the chain")
                present = await http.post(f"{b.url}{KV}/lookup", json={"keys": list(stored)})
                assert present.json()["present"] == [False] * len(stored)
                metrics = (await http.get(f"{b.url}/metrics")).text
                lost = metric_value(metrics, "ownerserve_sidecar_store_lost_artifacts_total")
                assert lost == len(stored)
                for key in stored:
                    assert (await http.get(f"{b.url}{KV}/artifacts/{key}")).status_code == 404
    finally:
        await directory.close()
