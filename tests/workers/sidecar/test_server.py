"""The sidecar's HTTP API over real sockets: two sidecars served in this event loop (uvicorn),
artifacts moved between them by `POST /ownerserve/kv/fetch` over the real TCP transport."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ownerserve.kvstate.heads import head_keys
from workers.sidecar.server import Sidecar, SidecarConfig, serving
from workers.sidecar.store import checksum
from workers.sidecar.transports import TCP, Transport, mooncake_status, select_transport

MODEL = "m"
HEADS = range(2)


def keys_of(chunk: int) -> list[str]:
    return head_keys(MODEL, chunk, HEADS)


def payload(key: str, size: int = 3000) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def transport_named(name: str) -> Transport:
    """TCP always; Mooncake when it runs here, else the test skips saying why."""
    if name == "tcp":
        return TCP
    module, reason = mooncake_status()
    if module is None:
        pytest.skip(reason)
    return select_transport("mooncake")


@contextlib.asynccontextmanager
async def sidecar(
    tmp_path: Path, name: str, transport: Transport = TCP, **overrides: Any
) -> AsyncIterator[Sidecar]:
    config = SidecarConfig(worker_id=name, store_dir=tmp_path / name, port=0, **overrides)
    async with serving(config, transport) as sc:
        yield sc


async def artifact_file(sc: Sidecar, key: str) -> Path:
    """The SSD-tier file of `key` (a sidecar with `memory_bytes=0` keeps every artifact in one),
    once the store's writer thread has written it."""
    await asyncio.to_thread(sc.store.flush)
    safe = re.sub(r"[^A-Za-z0-9._@:-]", "_", key)
    (path,) = sc.config.store_dir.rglob(f"{glob.escape(safe)}.*.kv")
    return path


def flip_a_byte(path: Path) -> None:
    """Corrupt a stored artifact on disk (its payload's last byte)."""
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x7F
    path.write_bytes(bytes(raw))


async def put_chunks(http: httpx.AsyncClient, sc: Sidecar, chunks: list[int]) -> None:
    for chunk in chunks:
        for key in keys_of(chunk):
            r = await http.put(f"{sc.url}/ownerserve/kv/artifacts/{key}", content=payload(key))
            assert r.status_code == 201, r.text


def fetch_body(src: Sidecar, chunks: list[int]) -> dict[str, Any]:
    return {
        "source_url": src.url,
        "source_worker": src.config.worker_id,
        "model": MODEL,
        "block_hashes": chunks,
        "token_ids": list(range(16 * len(chunks))),
        "block_size": 16,
    }


async def fetched(
    http: httpx.AsyncClient, dst: Sidecar, src: Sidecar, chunks: list[int]
) -> dict[str, Any]:
    """`dst` fetches `chunks` from `src`: its 200 answer (blocks, artifacts and bytes moved)."""
    r = await http.post(f"{dst.url}/ownerserve/kv/fetch", json=fetch_body(src, chunks))
    assert r.status_code == 200, r.text
    return dict(r.json())


async def assert_serves(http: httpx.AsyncClient, sc: Sidecar, chunks: list[int]) -> None:
    """`sc` serves every head of `chunks`, each with its own payload."""
    for chunk in chunks:
        for key in keys_of(chunk):
            got = await http.get(f"{sc.url}/ownerserve/kv/artifacts/{key}")
            assert got.content == payload(key)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


async def test_put_get_lookup_and_health(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "a") as a, httpx.AsyncClient() as http:
        key = keys_of(0xABC)[1]
        data = os.urandom(5000)
        digest = checksum(data).hex()
        r = await http.put(
            f"{a.url}/ownerserve/kv/artifacts/{key}",
            content=data,
            headers={"x-ownerserve-checksum": digest},
        )
        assert r.status_code == 201 and r.json()["checksum"] == digest
        r = await http.get(f"{a.url}/ownerserve/kv/artifacts/{key}")
        assert r.content == data and r.headers["x-ownerserve-checksum"] == digest
        r = await http.post(f"{a.url}/ownerserve/kv/lookup", json={"keys": ["x", key, "y"]})
        assert r.json() == {"present": [False, True, False]}
        h = (await http.get(f"{a.url}/health")).json()
        assert h["worker_id"] == "a" and h["transport"] == "tcp" and h["transfer_port"] > 0
        assert (h["artifacts"], h["bytes"]) == (1, 5000)


async def test_bad_requests_get_openai_errors(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "a") as a, httpx.AsyncClient() as http:
        kv = f"{a.url}/ownerserve/kv"
        err = assert_openai_error(await http.get(f"{kv}/artifacts/absent"), 404)
        assert err["code"] == "artifact_not_found"
        wrong = checksum(b"other").hex()
        r = await http.put(
            f"{kv}/artifacts/k", content=b"data", headers={"x-ownerserve-checksum": wrong}
        )
        assert_openai_error(r, 400)
        sha256 = hashlib.sha256(b"data").hexdigest()  # right bytes, wrong algorithm
        for bad in ("zz", sha256):
            r = await http.put(
                f"{kv}/artifacts/k", content=b"data", headers={"x-ownerserve-checksum": bad}
            )
            assert "XXH3-128 hex digest (32 hex digits)" in assert_openai_error(r, 400)["message"]
        assert (await http.post(f"{kv}/lookup", json={"keys": ["k"]})).json()["present"] == [False]
        assert_openai_error(await http.post(f"{kv}/lookup", content=b"{not json"), 400)
        assert_openai_error(await http.post(f"{kv}/lookup", json={"keys": 3}), 400)
        bad_fetch = {"source_url": "ftp://x", "model": MODEL, "block_hashes": [1]}
        assert_openai_error(await http.post(f"{kv}/fetch", json=bad_fetch), 400)
        negative = {**fetch_body(a, [1]), "block_hashes": [-1]}
        assert_openai_error(await http.post(f"{kv}/fetch", json=negative), 400)
        assert_openai_error(await http.get(f"{a.url}/nope"), 404)
        assert_openai_error(await http.delete(f"{kv}/lookup"), 405)


async def test_artifact_larger_than_the_limit_is_refused_with_413(tmp_path: Path) -> None:
    async with (
        sidecar(tmp_path, "a", max_artifact_bytes=1000) as a,
        httpx.AsyncClient() as http,
    ):
        r = await http.put(f"{a.url}/ownerserve/kv/artifacts/k", content=b"x" * 1001)
        assert_openai_error(r, 413)
        assert not a.store.has("k")


async def test_a_corrupted_file_is_dropped_and_answered_404(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "a", memory_bytes=0) as a, httpx.AsyncClient() as http:
        key = keys_of(7)[0]
        await http.put(f"{a.url}/ownerserve/kv/artifacts/{key}", content=payload(key))
        await asyncio.to_thread(a.store.flush)  # the file is written behind
        (path,) = (tmp_path / "a").rglob("*.kv")  # --memory-bytes 0: every artifact in a file
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(bytes(raw))
        err = assert_openai_error(await http.get(f"{a.url}/ownerserve/kv/artifacts/{key}"), 404)
        assert "checksum" in err["message"]
        r = await http.post(f"{a.url}/ownerserve/kv/lookup", json={"keys": [key]})
        assert r.json() == {"present": [False]}
        metrics = (await http.get(f"{a.url}/metrics")).text
        assert "ownerserve_sidecar_corrupted_artifacts 1.0" in metrics


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
async def test_fetch_pulls_every_head_of_the_stored_prefix(tmp_path: Path, transport: str) -> None:
    tr = transport_named(transport)
    async with (
        sidecar(tmp_path, "a", tr) as a,
        sidecar(tmp_path, "b", tr, memory_bytes=4000) as b,  # small: some land in files
        httpx.AsyncClient() as http,
    ):
        assert (await http.get(f"{b.url}/health")).json()["transport"] == transport
        chunks = [0x11, 0x22, 0x33, 0x44, 0x55]
        await put_chunks(http, a, [0x11, 0x22, 0x33, 0x55])  # 0x44 missing: prefix of 3
        assert await fetched(http, b, a, chunks) == {"blocks": 3, "artifacts": 6, "bytes": 6 * 3000}
        await assert_serves(http, b, chunks[:3])
        r = await http.post(
            f"{b.url}/ownerserve/kv/lookup", json={"keys": keys_of(0x44) + keys_of(0x55)}
        )
        assert not any(r.json()["present"])
        # again: everything is already here, nothing moves
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, chunks[:3]))
        assert r.json() == {"blocks": 3, "artifacts": 0, "bytes": 0}
        metrics = (await http.get(f"{b.url}/metrics")).text
        assert 'ownerserve_sidecar_fetches_total{result="ok"} 2.0' in metrics
        assert "ownerserve_sidecar_fetched_bytes_total 18000.0" in metrics
        assert 'ownerserve_sidecar_bytes{tier="ssd"}' in metrics


async def test_a_block_is_served_and_published_only_once_every_declared_head_is_stored(
    tmp_path: Path,
) -> None:
    """The writer declares two artifacts per block (`x-ownerserve-block-artifacts`) and stores
    them one at a time: until the second one, the block is in no index answer, no holding to
    publish and no fetch, though its first key is stored and can be looked up."""
    async with (
        sidecar(tmp_path, "a") as a,
        sidecar(tmp_path, "b") as b,
        httpx.AsyncClient() as http,
    ):
        first, second = keys_of(0x77)

        async def put(key: str, declared: str) -> httpx.Response:
            return await http.put(
                f"{a.url}/ownerserve/kv/artifacts/{key}",
                content=payload(key),
                headers={"x-ownerserve-block-artifacts": declared},
            )

        assert (await put(first, "2")).status_code == 201
        index = {"model": MODEL, "chunk_hashes": [0x77]}
        r = await http.post(f"{a.url}/ownerserve/kv/index", json=index)
        assert r.json()["keys"] == [[]] and 0x77 not in a.holdings()
        r = await http.post(f"{a.url}/ownerserve/kv/lookup", json={"keys": [first]})
        assert r.json() == {"present": [True]}
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [0x77]))
        assert r.json() == {"blocks": 0, "artifacts": 0, "bytes": 0}

        assert (await put(second, "2")).status_code == 201
        r = await http.post(f"{a.url}/ownerserve/kv/index", json=index)
        assert r.json()["keys"] == [sorted([first, second])] and 0x77 in a.holdings()
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [0x77]))
        assert r.json() == {"blocks": 1, "artifacts": 2, "bytes": 2 * 3000}
        assert 0x77 in b.holdings()
        for bad in ("0", "-1", "two", "4097"):
            assert_openai_error(await put(first, bad), 400)


async def test_fetch_from_a_dead_source_is_502_and_stores_nothing(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "b") as b, httpx.AsyncClient() as http:
        async with sidecar(tmp_path, "a") as a:
            await put_chunks(http, a, [1, 2])
            body = fetch_body(a, [1, 2])
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=body)  # `a` is gone
        err = assert_openai_error(r, 502)
        assert err["type"] == "upstream_error" and err["code"] == "kv_fetch_failed"
        assert b.store.keys() == []
        metrics = (await http.get(f"{b.url}/metrics")).text
        assert 'ownerserve_sidecar_fetches_total{result="failed"} 1.0' in metrics


async def test_transfer_server_gone_after_the_index_is_502_and_keeps_no_partial_block(
    tmp_path: Path,
) -> None:
    """The source answers its index, then its transfer server is gone (closed here, as a
    crash between the two steps would leave it)."""
    async with (
        sidecar(tmp_path, "a") as a,
        sidecar(tmp_path, "b") as b,
        httpx.AsyncClient() as http,
    ):
        await put_chunks(http, a, [1, 2])
        await a.transfer_server.close()
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [1, 2]))
        assert_openai_error(r, 502)
        assert b.store.keys() == []


def test_drop_incomplete_deletes_only_what_this_fetch_brought_of_an_unfinished_block(
    tmp_path: Path,
) -> None:
    """A source dying mid-block leaves some heads of a block here: they go, whole blocks stay
    (the kill itself is in tests/e2e/test_sidecar.py)."""
    sc = Sidecar.create(SidecarConfig(worker_id="b", store_dir=tmp_path / "b"), TCP)
    blocks = [keys_of(1), keys_of(2), keys_of(3)]
    for key in [*blocks[0], blocks[1][0], blocks[2][0]]:
        sc.store.put(key, payload(key))
    # blocks[2][0] was here before this fetch; blocks[1][0] came with it
    whole = sc._drop_incomplete(blocks, {*blocks[0], blocks[1][0]})
    assert whole == 1
    assert all(sc.store.has(k) for k in blocks[0])
    assert not sc.store.has(blocks[1][0])
    assert sc.store.has(blocks[2][0])


async def test_concurrent_fetches_of_one_prefix_move_it_once(tmp_path: Path) -> None:
    async with (
        sidecar(tmp_path, "a") as a,
        sidecar(tmp_path, "b") as b,
        httpx.AsyncClient() as http,
    ):
        chunks = list(range(100, 140))
        await put_chunks(http, a, chunks)
        url = f"{b.url}/ownerserve/kv/fetch"
        first, second = await asyncio.gather(
            http.post(url, json=fetch_body(a, chunks)), http.post(url, json=fetch_body(a, chunks))
        )
        answers = [first.json(), second.json()]
        assert [x["blocks"] for x in answers] == [40, 40]
        assert sum(x["artifacts"] for x in answers) == 80  # each artifact pulled by one of them
        metrics = (await http.get(f"{b.url}/metrics")).text
        assert f"ownerserve_sidecar_fetched_bytes_total {80 * 3000}.0" in metrics


async def test_the_advertised_host_is_the_transfer_host_peers_use(tmp_path: Path) -> None:
    async with (
        sidecar(tmp_path, "a", advertise_url="http://localhost:9") as a,
        sidecar(tmp_path, "b") as b,
        httpx.AsyncClient() as http,
    ):
        real = f"http://127.0.0.1:{a.bound_port}"
        assert (await http.get(f"{real}/health")).json()["url"] == "http://localhost:9"
        for key in keys_of(1):
            await http.put(f"{real}/ownerserve/kv/artifacts/{key}", content=payload(key))
        index = await http.post(
            f"{real}/ownerserve/kv/index", json={"model": MODEL, "chunk_hashes": [1, 2]}
        )
        assert index.json()["keys"] == [keys_of(1), []]
        assert index.json()["transfer_host"] == "localhost"
        body = {**fetch_body(a, [1]), "source_url": real}
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=body)
        assert r.json() == {"blocks": 1, "artifacts": 2, "bytes": 6000}


async def test_artifacts_too_large_for_the_destination_are_a_502_not_a_crash(
    tmp_path: Path,
) -> None:
    async with (
        sidecar(tmp_path, "a") as a,
        sidecar(tmp_path, "b", memory_bytes=1000, ssd_bytes=1000) as b,
        httpx.AsyncClient() as http,
    ):
        await put_chunks(http, a, [1])  # 3000-byte artifacts
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [1]))
        assert_openai_error(r, 502)
        assert b.store.keys() == []


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
async def test_ssd_writes_wait_in_the_stores_thread_and_the_artifacts_are_served_meanwhile(
    tmp_path: Path, transport: str
) -> None:
    """The sidecar's store writes its SSD tier behind (workers.sidecar.store): a PUT that
    demotes returns while the file is not written yet, the artifact is served from memory
    meanwhile and from its file (read in a thread) after, and closing waits for the files."""
    async with (
        sidecar(
            tmp_path, "a", transport_named(transport), memory_bytes=4000, ssd_bytes=100_000
        ) as a,
        sidecar(tmp_path, "b", transport_named(transport)) as b,
        httpx.AsyncClient() as http,
    ):
        ssd = tmp_path / "a" / "ssd"
        held = threading.Event()
        a.store._submit(held.wait)  # the writer thread is busy: every SSD write waits
        await put_chunks(http, a, [1])  # two 3000-byte artifacts: the first is demoted
        first = keys_of(1)[0]
        assert a.store.meta(first).tier.value == "ssd" and list(ssd.glob("*.kv")) == []
        assert a.store.stats().ssd_pending_bytes == 3000
        r = await http.get(f"{a.url}/ownerserve/kv/artifacts/{first}")
        assert r.status_code == 200 and r.content == payload(first)
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [1]))
        assert r.json() == {"blocks": 1, "artifacts": 2, "bytes": 6000}
        held.set()
        await asyncio.to_thread(a.store.flush)
        (path,) = ssd.glob("*.kv")
        b.store.delete(first)
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [1]))
        assert r.json()["artifacts"] == 1 and b.store.get(first) == payload(first)
        r = await http.get(f"{a.url}/ownerserve/kv/artifacts/{first}")
        assert r.status_code == 200 and r.content == payload(first)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        r = await http.get(f"{a.url}/ownerserve/kv/artifacts/{first}")
        assert "failed its checksum" in assert_openai_error(r, 404)["message"]
        assert not a.store.has(first)
        held.clear()
        a.store._submit(held.wait)
        await put_chunks(http, a, [2])  # demotes the second of chunk 1, then the first of 2
        assert a.store.stats().ssd_pending_bytes == 6000
        threading.Timer(0.2, held.set).start()
    # closed: the writes that waited are in their files
    assert len(list(ssd.glob("*.kv"))) == 2 and held.is_set()
