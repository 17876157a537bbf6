"""The connector's load against a real sidecar (served in this event loop, over real HTTP):
`SidecarClient.get_many_into` reads batch answers straight into staging slots, each payload
verified there, and `load.load_blocks` (what the load thread runs) writes the good prefix into a
cache shaped like vLLM's, through pinned staging on CUDA (`CudaPagedKV`) and through `bytes` on
the CPU backend (`CpuAttnKV`). No vLLM needed; the CUDA cases skip without a GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.workers.sidecar.test_server import artifact_file, flip_a_byte, payload, sidecar
from tests.workers.vllm_connector.test_gpu_path import (
    DEVICES,
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
from workers.sidecar.server import Sidecar
from workers.vllm_connector import client as client_module
from workers.vllm_connector.client import ArtifactRejected, SidecarClient
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.load import load_blocks
from workers.vllm_connector.payload import CpuAttnKV, PageOrder, payload_of
from workers.vllm_connector.plan import block_keys

SIZE = 3000


def slots(n: int, size: int = SIZE) -> list[memoryview]:
    buf = bytearray(n * size)
    return [memoryview(buf)[i * size : (i + 1) * size] for i in range(n)]


async def test_get_many_into_reads_good_artifacts_and_refuses_a_corrupted_one_alone(
    tmp_path: Path,
) -> None:
    keys = [f"k{i}" for i in range(5)]
    async with sidecar(tmp_path, "a", memory_bytes=0) as a:
        client = SidecarClient(a.url)
        try:
            await asyncio.to_thread(client.put_many, [(k, payload(k)) for k in keys])
            out = slots(6)
            got = await asyncio.to_thread(client.get_many_into, [*keys, "absent"], out)
            assert got[:5] == [None] * 5
            assert [bytes(s) for s in out[:5]] == [payload(k) for k in keys]
            assert isinstance(got[5], ArtifactRejected) and "not stored" in str(got[5])

            flip_a_byte(await artifact_file(a, keys[2]))
            out = slots(5)
            got = await asyncio.to_thread(client.get_many_into, keys, out)
            # the sidecar drops the corrupted one and says so; the others are in their slots
            assert [g is None for g in got] == [True, True, False, True, True]
            assert [bytes(out[i]) for i in (0, 1, 3, 4)] == [payload(keys[i]) for i in (0, 1, 3, 4)]
            assert not a.store.has(keys[2])
            # a slot of another size refuses its artifact, and the rest of the answer still lands
            small = [*slots(1), memoryview(bytearray(SIZE - 1)), *slots(1)]
            got = await asyncio.to_thread(client.get_many_into, [keys[0], keys[1], keys[3]], small)
            assert got[0] is None and got[2] is None
            assert isinstance(got[1], ArtifactRejected) and "expected 2999" in str(got[1])
            assert bytes(small[2]) == payload(keys[3])
        finally:
            client.close()


async def test_get_many_into_checks_the_payload_in_its_slot_against_the_sent_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload damaged between the sidecar's check and the slot (here: the sidecar's bytes
    changed after their checksum was taken) is refused by the client."""
    async with sidecar(tmp_path, "a") as a:
        client = SidecarClient(a.url)
        try:
            await asyncio.to_thread(client.put_many, [("k", payload("k")), ("j", payload("j"))])
            real_get = Sidecar.get

            async def damaged(self: Sidecar, key: str) -> tuple[bytes, bytes]:
                data, digest = await real_get(self, key)
                return (data[:-1] + b"\0" if key == "k" else data), digest

            monkeypatch.setattr(Sidecar, "get", damaged)
            out = slots(2)
            got = await asyncio.to_thread(client.get_many_into, ["k", "j"], out)
            assert isinstance(got[0], ArtifactRejected) and "checksum" in str(got[0])
            assert got[1] is None and bytes(out[1]) == payload("j")
        finally:
            client.close()


async def test_get_many_into_splits_a_large_set_into_several_batch_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "MAX_BATCH_BYTES", 2 * SIZE)
    calls: list[list[str]] = []
    real = SidecarClient._batch_get_into

    def counted(
        self: SidecarClient, keys: list[str], slots: list[memoryview]
    ) -> list[ArtifactRejected | None] | None:
        calls.append(keys)
        return real(self, keys, slots)

    monkeypatch.setattr(SidecarClient, "_batch_get_into", counted)
    keys = [f"k{i}" for i in range(7)]
    async with sidecar(tmp_path, "a") as a:
        client = SidecarClient(a.url)
        try:
            await asyncio.to_thread(client.put_many, [(k, payload(k)) for k in keys])
            out = slots(len(keys))
            got = await asyncio.to_thread(client.get_many_into, keys, out)
            assert got == [None] * len(keys)
            assert [bytes(s) for s in out] == [payload(k) for k in keys]
            assert calls == [keys[0:2], keys[2:4], keys[4:6], keys[6:7]]
        finally:
            client.close()


# ----- load_blocks: the load thread's work, end to end -----------------------------------------


def _saved_cache(device: str) -> tuple[CudaPagedKV, torch.Tensor, torch.Tensor]:
    k, v = random_kv(device)
    return make_kv(vllm_layers(k, v, "flashattn")), k, v


async def _save_blocks(client: SidecarClient, src: CudaPagedKV) -> list[list[str]]:
    """What the save thread does: gather the blocks, PUT every head of each (one batch call)."""
    staged = src.gather(SRC_IDS)
    heads = tuple(range(HEADS))
    rows = [block_keys(MODEL, chunk, heads) for chunk in HASHES]
    items = [
        (key, payload_of(staged, j, i)) for i, row in enumerate(rows) for j, key in enumerate(row)
    ]
    await asyncio.to_thread(client.put_many, items, HEADS)
    return rows


@pytest.mark.parametrize("device", DEVICES)
async def test_a_cuda_cache_loads_the_good_prefix_straight_into_pinned_staging(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, k, v = _saved_cache(device)
    async with sidecar(tmp_path, "a", memory_bytes=0) as a:
        client = SidecarClient(a.url)
        try:
            rows = await _save_blocks(client, src)
            bad_block = 2
            flip_a_byte(await artifact_file(a, rows[bad_block][5]))

            # the staged path never makes `bytes` of a payload: get_many is not called
            def no_bytes(*_: object) -> None:
                raise AssertionError("the CUDA path read payloads as bytes")

            monkeypatch.setattr(SidecarClient, "get_many", no_bytes)
            layers = nan_layers(device, HEADS, "flashattn")
            dst = make_kv(layers)
            outcome = await asyncio.to_thread(load_blocks, client, dst, rows, DST_IDS)
            assert outcome.blocks == bad_block
            assert outcome.refused is not None and rows[bad_block][5] in outcome.refused
            assert outcome.nbytes == bad_block * HEADS * dst.payload_nbytes
            got_k, got_v = kv_of(layers, "flashattn")
            good_src, good_dst = SRC_IDS[:bad_block], DST_IDS[:bad_block]
            assert torch.equal(got_k[:, good_dst], k[:, good_src])
            assert torch.equal(got_v[:, good_dst], v[:, good_src])
            # the refused block and those after it are untouched, for vLLM to recompute
            assert torch.isnan(got_k[:, DST_IDS[bad_block:]]).all()
            assert torch.isnan(got_v[:, DST_IDS[bad_block:]]).all()

            # once the sidecar holds every block again, the whole request loads
            staged = src.gather(SRC_IDS[bad_block : bad_block + 1])
            items = [(key, payload_of(staged, j, 0)) for j, key in enumerate(rows[bad_block])]
            await asyncio.to_thread(client.put_many, items, HEADS)
            outcome = await asyncio.to_thread(load_blocks, client, dst, rows, DST_IDS)
            assert (outcome.blocks, outcome.refused) == (len(DST_IDS), None)
            got_k, got_v = kv_of(layers, "flashattn")
            assert torch.equal(got_k[:, DST_IDS], k[:, SRC_IDS])
            assert torch.equal(got_v[:, DST_IDS], v[:, SRC_IDS])
            dst.close()
        finally:
            client.close()


async def test_a_sidecar_that_cannot_answer_refuses_every_block(tmp_path: Path) -> None:
    async with sidecar(tmp_path, "a") as a:
        url = a.url
    layers = nan_layers("cpu", HEADS, "flashattn")
    dst = make_kv(layers)
    rows = [block_keys(MODEL, chunk, tuple(range(HEADS))) for chunk in HASHES]
    outcome = load_blocks(SidecarClient(url, timeout_s=2.0), dst, rows, DST_IDS)
    assert outcome.blocks == 0 and outcome.refused is not None
    assert all(torch.isnan(t).all() for t in layers)


async def test_the_cpu_backend_and_the_cuda_path_load_the_same_prefix_from_one_sidecar(
    tmp_path: Path,
) -> None:
    """The CPU backend's load (`bytes`, `scatter_payloads`, the tested reference) and the staged
    one agree: same prefix, same K/V, same refusal."""
    src, k, v = _saved_cache("cpu")
    async with sidecar(tmp_path, "a", memory_bytes=0) as a:
        client = SidecarClient(a.url)
        try:
            rows = await _save_blocks(client, src)
            flip_a_byte(await artifact_file(a, rows[3][0]))
            staged_layers = nan_layers("cpu", HEADS, "flashattn")
            staged = await asyncio.to_thread(
                load_blocks, client, make_kv(staged_layers), rows, DST_IDS
            )
            # vLLM's CPU layout: [blocks, heads, block_size, 2 * dim], token-major pages here
            cpu_layers = [
                torch.full((10, HEADS, 16, 64), float("nan"), dtype=torch.bfloat16)
                for _ in staged_layers
            ]
            cpu_kv = CpuAttnKV(cpu_layers, PageOrder.token_major(16, 32))
            by_bytes = await asyncio.to_thread(load_blocks, client, cpu_kv, rows, DST_IDS)
            assert staged.blocks == by_bytes.blocks == 3
            got_k, got_v = kv_of(staged_layers, "flashattn")
            assert torch.equal(got_k[:, DST_IDS[:3]], k[:, SRC_IDS[:3]])
            assert torch.equal(got_v[:, DST_IDS[:3]], v[:, SRC_IDS[:3]])
            assert staged.nbytes == by_bytes.nbytes
            # the artifact the staged load refused was dropped: the CPU load finds it missing
            assert by_bytes.refused is not None and rows[3][0] in by_bytes.refused
            for layer, cpu in zip(staged_layers, cpu_layers, strict=True):
                for block in DST_IDS[:3]:
                    page = cpu[block].view(HEADS, 2, 16, 32)
                    assert torch.equal(page[:, 0], layer[0, block].transpose(0, 1))
                    assert torch.equal(page[:, 1], layer[1, block].transpose(0, 1))
                assert torch.isnan(cpu[DST_IDS[3]]).all()
        finally:
            client.close()
