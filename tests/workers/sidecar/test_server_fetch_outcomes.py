"""What a fetch between two real sidecars (served in this event loop, real transports) keeps
when something goes wrong: a failed fetch's 502 says how many whole blocks it holds, and a
source never serves an artifact that fails its checksum (it drops it and answers it missing, so
the destination keeps the good prefix instead of failing)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.workers.sidecar.test_server import (
    MODEL,
    artifact_file,
    assert_openai_error,
    assert_serves,
    fetch_body,
    fetched,
    flip_a_byte,
    keys_of,
    payload,
    put_chunks,
    sidecar,
    transport_named,
)
from workers.sidecar.server import Sidecar


async def put_declared(http: httpx.AsyncClient, sc: Sidecar, chunks: list[int]) -> None:
    """Store every head of `chunks`, each declaring that its block has two (as the connector
    does): a block missing a head is then not whole, so neither listed nor published."""
    for chunk in chunks:
        for key in keys_of(chunk):
            r = await http.put(
                f"{sc.url}/ownerserve/kv/artifacts/{key}",
                content=payload(key),
                headers={"x-ownerserve-block-artifacts": "2"},
            )
            assert r.status_code == 201, r.text


async def test_a_fetch_that_fails_partway_says_how_many_whole_blocks_it_kept(
    tmp_path: Path,
) -> None:
    """The third block's artifacts are larger than every tier of the destination: the fetch
    fails there (502) after the first two blocks arrived whole, and its answer says 2."""
    async with (
        sidecar(tmp_path, "a") as a,
        sidecar(tmp_path, "b", memory_bytes=20_000, ssd_bytes=20_000) as b,
        httpx.AsyncClient() as http,
    ):
        await put_chunks(http, a, [1, 2])
        for key in keys_of(3):
            r = await http.put(f"{a.url}/ownerserve/kv/artifacts/{key}", content=b"x" * 30_000)
            assert r.status_code == 201
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=fetch_body(a, [1, 2, 3]))
        err = assert_openai_error(r, 502)
        assert (err["type"], err["code"]) == ("upstream_error", "kv_fetch_failed")
        assert set(r.json()) == {"error", "blocks"} and r.json()["blocks"] == 2
        assert sorted(b.store.keys()) == sorted(keys_of(1) + keys_of(2))
        assert {1, 2} <= set(b.holdings())


async def test_a_fetch_whose_source_is_gone_says_what_was_already_here(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "b") as b, httpx.AsyncClient() as http:
        async with sidecar(tmp_path, "a") as a:
            await put_chunks(http, a, [1, 2, 3])
            body = fetch_body(a, [1, 2, 3])
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=body)  # `a` is gone
        assert_openai_error(r, 502)
        assert r.json()["blocks"] == 0
        await put_chunks(http, b, [1])  # the first block was here already
        r = await http.post(f"{b.url}/ownerserve/kv/fetch", json=body)
        assert_openai_error(r, 502)
        assert r.json()["blocks"] == 1


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
async def test_a_source_drops_a_corrupted_artifact_and_the_fetch_keeps_the_good_prefix(
    tmp_path: Path, transport: str
) -> None:
    tr = transport_named(transport)
    async with (
        sidecar(tmp_path, "a", tr, memory_bytes=0) as a,  # files: one can be corrupted
        sidecar(tmp_path, "b", tr) as b,
        sidecar(tmp_path, "c", tr) as c,
        httpx.AsyncClient() as http,
    ):
        chunks = [0x11, 0x22, 0x33, 0x44]
        await put_declared(http, a, chunks)
        bad = keys_of(0x33)[1]
        flip_a_byte(await artifact_file(a, bad))

        # the index still lists the block; the transfer finds the corrupted artifact
        answer = await fetched(http, b, a, chunks)
        # the whole block after the refused one came too, and stays (it counts as moved)
        assert answer == {"blocks": 2, "artifacts": 6, "bytes": 6 * 3000}
        await assert_serves(http, b, chunks[:2])
        # nothing of the refused block stays at the destination
        present = await http.post(f"{b.url}/ownerserve/kv/lookup", json={"keys": keys_of(0x33)})
        assert present.json() == {"present": [False, False]}

        # the source dropped it: no longer stored, listed or published
        assert not a.store.has(bad)
        assert 0x33 not in a.holdings() and {0x11, 0x22, 0x44} <= set(a.holdings())
        index = {"model": MODEL, "chunk_hashes": chunks}
        r = await http.post(f"{a.url}/ownerserve/kv/index", json=index)
        assert [bool(keys) for keys in r.json()["keys"]] == [True, True, False, True]
        metrics = (await http.get(f"{a.url}/metrics")).text
        assert "ownerserve_sidecar_corrupted_artifacts 1.0" in metrics

        # a later fetch from it stops before the block at once
        r = await http.post(f"{c.url}/ownerserve/kv/fetch", json=fetch_body(a, chunks))
        assert r.json() == {"blocks": 2, "artifacts": 4, "bytes": 4 * 3000}
