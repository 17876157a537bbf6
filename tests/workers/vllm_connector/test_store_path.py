"""The connector's Mooncake Store path (`store_path.StoreKV`) against a real `mooncake_master`
and a real sidecar on the same store (served in this event loop, real HTTP): a save (gather into
registered staging, one batch put) then a load (one batch get into registered slots, verified in
place, one scatter) round-trips bit-exactly, across TP sizes too; the sidecar holds, indexes and
answers lookups for what the connector reported; a missing or corrupted object ends the load's
good prefix and is reported gone. CPU tensors (the CUDA half runs in
`bench/kernels/connector_store.py` on a GPU host)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import httpx
import pytest
import torch

from ownerserve.kvstate.heads import heads_for_rank, store_heads_for_rank
from tests.workers.sidecar.test_server import sidecar
from tests.workers.vllm_connector.test_gpu_path import (
    DST_IDS,
    HASHES,
    HEADS,
    MODEL,
    SRC_IDS,
    kv_of,
    make_kv,
    nan_layers,
    random_kv,
    vllm_layers,
)
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    ClientSettings,
    MasterUnavailable,
    MooncakeMaster,
    StoreClient,
)
from workers.sidecar.server import Sidecar
from workers.vllm_connector.client import SidecarClient
from workers.vllm_connector.payload import CpuAttnKV, WorkerKV
from workers.vllm_connector.plan import ConnectorSettings, block_keys
from workers.vllm_connector.store_path import StoreKV, open_store_kv

LAYOUT = "flashattn"


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


@contextlib.asynccontextmanager
async def on_store(tmp_path: Path, master: MooncakeMaster) -> AsyncIterator[Sidecar]:
    async with sidecar(
        tmp_path, "w0", store=master.address.url, store_segment_bytes=64 << 20
    ) as sc:
        yield sc


@contextlib.contextmanager
def store_kv(
    master: MooncakeMaster, kv: WorkerKV, *, segment_bytes: int = 0, staging_bytes: int = 8 << 20
) -> Iterator[StoreKV]:
    client = StoreClient.open(
        ClientSettings(master.address, segment_bytes=segment_bytes, digest_threads=2)
    )
    try:
        skv = StoreKV(client, kv, staging_bytes=staging_bytes)
        try:
            yield skv
        finally:
            skv.close()
    finally:
        client.close()


def save(skv: StoreKV, total: int, tp: int, rank: int) -> list[tuple[str, int, bytes]]:
    """What the save thread does: gather `SRC_IDS`, put every stored head's payload."""
    staged = skv.gather(SRC_IDS)
    assert staged is not None
    local = heads_for_rank(total, tp, rank)
    heads = store_heads_for_rank(total, tp, rank)
    rows = [
        [(local.index(h), k) for h, k in zip(heads, block_keys(MODEL, c, heads), strict=True)]
        for c in HASHES
    ]
    outcome = skv.put(staged, rows)
    assert outcome.refused == []
    return outcome.stored


def rows_for(heads: Sequence[int]) -> list[list[str]]:
    return [block_keys(MODEL, c, heads) for c in HASHES]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


async def report(sc: Sidecar, stored: list[tuple[str, int, bytes]], **kw: object) -> list[str]:
    client = SidecarClient(sc.url)
    try:
        return await asyncio.to_thread(client.report_store, stored, HEADS, **kw)  # type: ignore[arg-type]
    finally:
        client.close()


@pytest.mark.parametrize("segment_bytes", [0, 64 << 20], ids=["sidecar-segment", "own-segment"])
async def test_save_then_load_round_trips_bit_exactly_and_the_sidecar_holds_the_blocks(
    tmp_path: Path, master: MooncakeMaster, segment_bytes: int
) -> None:
    k, v = random_kv("cpu")
    async with on_store(tmp_path, master) as sc:
        with store_kv(master, make_kv(vllm_layers(k, v, LAYOUT)), segment_bytes=segment_bytes) as w:
            stored = await asyncio.to_thread(save, w, HEADS, 1, 0)
            assert len(stored) == HEADS * len(SRC_IDS)
            assert w._saves.free_bytes() == w._saves.nbytes  # the extent went back
            assert sc.held_prefix(MODEL, HASHES) == 0  # not reported yet
            assert await report(sc, stored) == []
            assert sc.held_prefix(MODEL, HASHES) == len(HASHES)
            # the sidecar serves the connector's objects byte for byte over HTTP as well
            key = block_keys(MODEL, HASHES[1], [3])[0]
            async with httpx.AsyncClient(base_url=sc.url) as http:
                got = await http.get(f"/ownerserve/kv/artifacts/{key}")
            assert got.status_code == 200
            (kv_row,) = [s for s in stored if s[0] == key]
            assert got.headers["x-ownerserve-checksum"] == kv_row[2].hex()
            assert len(got.content) == w.kv.payload_nbytes

            # another engine's client (objects in the writer's own segment live as long as it)
            layers = nan_layers("cpu", HEADS, LAYOUT)
            with store_kv(master, make_kv(layers)) as r:
                result = await asyncio.to_thread(r.load, rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.load.refused, result.dropped) == (len(DST_IDS), None, [])
        k2, v2 = kv_of(layers, LAYOUT)
        assert torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS]))
        assert torch.equal(bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS]))


async def test_tp2_saves_load_bit_exactly_into_tp1_and_tp1_saves_into_tp4_ranks(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    k, v = random_kv("cpu")
    async with on_store(tmp_path, master) as sc:
        for rank in range(2):
            heads = heads_for_rank(HEADS, 2, rank)
            part = slice(heads[0], heads[-1] + 1)
            producer = make_kv(vllm_layers(k[..., part, :], v[..., part, :], LAYOUT))
            with store_kv(master, producer) as w:
                assert await report(sc, await asyncio.to_thread(save, w, HEADS, 2, rank)) == []
        assert sc.held_prefix(MODEL, HASHES) == len(HASHES)  # whole once both ranks reported

        layers = nan_layers("cpu", HEADS, LAYOUT)
        with store_kv(master, make_kv(layers)) as r:
            result = await asyncio.to_thread(r.load, rows_for(range(HEADS)), DST_IDS)
        assert result.load.blocks == len(DST_IDS)
        k2, v2 = kv_of(layers, LAYOUT)
        assert torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS]))
        assert torch.equal(bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS]))

        for rank in range(4):  # each TP=4 rank loads its 2 heads of the same artifacts
            heads = heads_for_rank(HEADS, 4, rank)
            layers = nan_layers("cpu", len(heads), LAYOUT)
            with store_kv(master, make_kv(layers)) as r:
                result = await asyncio.to_thread(r.load, rows_for(heads), DST_IDS)
            assert result.load.blocks == len(DST_IDS)
            part = slice(heads[0], heads[-1] + 1)
            k2, v2 = kv_of(layers, LAYOUT)
            assert torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS][..., part, :]))
            assert torch.equal(bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS][..., part, :]))


async def test_a_missing_or_corrupted_object_ends_the_good_prefix_and_is_reported_gone(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    k, v = random_kv("cpu")
    async with on_store(tmp_path, master) as sc:
        with store_kv(master, make_kv(vllm_layers(k, v, LAYOUT))) as w:
            assert await report(sc, await asyncio.to_thread(save, w, HEADS, 1, 0)) == []
            store = w.client
            unit = w.kv.payload_nbytes
            corrupt = block_keys(MODEL, HASHES[2], [5])[0]
            gone = block_keys(MODEL, HASHES[1], [0])[0]
            # a corrupted object: same length, payload not matching its digest
            assert await asyncio.to_thread(store.remove, [corrupt]) == [True]
            assert (
                await asyncio.to_thread(store.put_raw, corrupt, bytes(unit + CHECKSUM_BYTES)) == 0
            )

            layers = nan_layers("cpu", HEADS, LAYOUT)
            with store_kv(master, make_kv(layers)) as r:
                result = await asyncio.to_thread(r.load, rows_for(range(HEADS)), DST_IDS)
                assert (result.load.blocks, result.dropped) == (2, [corrupt])
                assert result.load.refused is not None and "corrupted" in result.load.refused
                # the corrupted object left the store: a later save writes it again
                assert await asyncio.to_thread(store.exists, [corrupt]) == [False]
                k2, v2 = kv_of(layers, LAYOUT)
                assert torch.equal(bits(k2[:, DST_IDS[:2]]), bits(k[:, SRC_IDS[:2]]))
                assert torch.equal(bits(v2[:, DST_IDS[:2]]), bits(v[:, SRC_IDS[:2]]))
                assert torch.isnan(k2[:, DST_IDS[2:]].float()).all()

                assert await asyncio.to_thread(store.remove, [gone]) == [True]
                result = await asyncio.to_thread(r.load, rows_for(range(HEADS)), DST_IDS)
                assert (result.load.blocks, result.dropped) == (1, [gone, corrupt])
                assert result.load.refused is not None and "missing" in result.load.refused

            # reported, the sidecar no longer holds them: its lookups stop offering the blocks
            assert sc.held_prefix(MODEL, HASHES) == len(HASHES)
            await report(sc, [], dropped=result.dropped)
            assert not sc.has(gone) and not sc.has(corrupt)
            assert sc.held_prefix(MODEL, HASHES) == 1


async def test_the_sidecar_holds_only_reported_objects_it_finds_in_its_store(
    tmp_path: Path, master: MooncakeMaster
) -> None:
    async with on_store(tmp_path, master) as sc:
        key = block_keys(MODEL, HASHES[0], [0])[0]
        assert await report(sc, [(key, 10, bytes(16))]) == [key]
        assert not sc.has(key)
        async with httpx.AsyncClient(base_url=sc.url) as http:
            bad = await http.post(
                "/ownerserve/kv/store/report",
                json={"stored": [{"key": key, "bytes": 10, "checksum": "zz"}]},
            )
            assert bad.status_code == 400
            assert "x-ownerserve-checksum" in bad.json()["error"]["message"]
            bad = await http.post("/ownerserve/kv/store/report", json={"stored": [{"key": key}]})
            assert bad.status_code == 400
    async with sidecar(tmp_path, "plain") as plain, httpx.AsyncClient(base_url=plain.url) as http:
        refused = await http.post("/ownerserve/kv/store/report", json={"dropped": [key]})
        assert refused.status_code == 400
        assert "--store" in refused.json()["error"]["message"]


def test_a_save_finding_no_staging_room_is_dropped_and_a_large_load_goes_in_rounds(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    kv = make_kv(vllm_layers(k, v, LAYOUT))
    block = HEADS * (kv.payload_nbytes + CHECKSUM_BYTES)
    # room for three blocks: a save of four does not fit, one of two does, twice not
    with store_kv(master, kv, segment_bytes=64 << 20, staging_bytes=3 * block) as w:
        assert w.gather(SRC_IDS) is None
        first = w.gather(SRC_IDS[:2])
        assert first is not None and w.gather(SRC_IDS[2:]) is None
        first.release()
        assert w._saves.free_bytes() == w._saves.nbytes
        staged = w.gather(SRC_IDS[:3])
        assert staged is not None
        rows = [[(h, k) for h, k in enumerate(block_keys(MODEL, c, range(HEADS)))] for c in HASHES]
        assert w.put(staged, rows[:3]).refused == []
        staged = w.gather(SRC_IDS[3:])
        assert staged is not None and w.put(staged, rows[3:]).refused == []

        layers = nan_layers("cpu", HEADS, LAYOUT)
        with store_kv(master, make_kv(layers), staging_bytes=3 * block) as r:
            result = r.load(rows_for(range(HEADS)), DST_IDS)  # three blocks, then one
        assert result.load.blocks == len(DST_IDS)
        k2, v2 = kv_of(layers, LAYOUT)
        assert torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS]))
        assert torch.equal(bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS]))


def test_vllm_cpu_backend_caches_round_trip_through_the_store(master: MooncakeMaster) -> None:
    g = torch.Generator().manual_seed(3)
    shape = (10, 2, 16, 2 * 8)  # [blocks, kv_heads, block_size, 2 * head_size]
    src = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
    rows = [block_keys(MODEL, c, range(2)) for c in HASHES]
    with store_kv(master, CpuAttnKV(src), segment_bytes=16 << 20) as w:
        staged = w.gather(SRC_IDS)
        assert staged is not None
        assert w.put(staged, [list(enumerate(r)) for r in rows]).refused == []
        with store_kv(master, CpuAttnKV(dst)) as r:
            assert r.load(rows, DST_IDS).load.blocks == len(DST_IDS)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(bits(a[SRC_IDS]), bits(b[DST_IDS]))


def test_open_store_kv_reads_the_connectors_settings(master: MooncakeMaster) -> None:
    settings = ConnectorSettings.from_extra_config(
        {
            "sidecar_url": "http://127.0.0.1:1",
            "store": master.address.url,
            "store_staging_bytes": 4 << 20,
            "store_segment_bytes": 32 << 20,
        },
        default_model=MODEL,
        block_size=16,
    )
    k, v = random_kv("cpu")
    skv = open_store_kv(settings, make_kv(vllm_layers(k, v, LAYOUT)))
    try:
        assert skv._saves.nbytes == 4 << 20 and skv.client.settings.segment_bytes == 32 << 20
    finally:
        skv.close()
        skv.client.close()
