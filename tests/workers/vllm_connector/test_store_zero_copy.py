"""The connector's zero-copy Mooncake Store path (`StoreKV(zero_copy=True)`) against a real
`mooncake_master`, on CPU tensors (the same logic as on a device: the digest in numpy, copies
by `memmove`; the CUDA run is at the end and in `bench/kernels/connector_store.py`): saves write
framed objects with a keyed-MAC digest straight into the client's own segment, loads read them
from there and verify them, and every object that cannot be read that way (in another
client's segment, corrupted in place, a cached replica now holding another key's object) is
read through the store and verified on the CPU. CPU readers (the store client, the sidecar's
store tier, the CPU path) read the GPU path's objects."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ownerserve.kvstate.heads import heads_for_rank
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
    checksum,
    verify,
)
from workers.mooncake_store.digest import MAC_TAG, is_mac, mac_digests
from workers.sidecar.store_tier import HeldArtifact, StoreTier
from workers.vllm_connector import gpu_digest
from workers.vllm_connector.gpu import CudaPagedKV
from workers.vllm_connector.host_copy import Run, strided_runs
from workers.vllm_connector.payload import CpuAttnKV
from workers.vllm_connector.plan import block_keys
from workers.vllm_connector.store_path import StoreKV

LAYOUT = "flashattn"
ROOT = Path(__file__).resolve().parents[3]
CUDA = torch.cuda.is_available()


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


def open_client(master: MooncakeMaster, segment_bytes: int = 64 << 20) -> StoreClient:
    return StoreClient.open(
        ClientSettings(master.address, segment_bytes=segment_bytes, replica_cache_s=30.0)
    )


def rows_for(heads: Sequence[int]) -> list[list[str]]:
    return [block_keys(MODEL, c, heads) for c in HASHES]


def save_rows() -> list[list[tuple[int, str]]]:
    return [list(enumerate(row)) for row in rows_for(range(HEADS))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def save(skv: StoreKV) -> list[tuple[str, int, bytes]]:
    staged = skv.gather(SRC_IDS)
    assert staged is not None and staged.on_device
    outcome = skv.put(staged, save_rows())
    assert outcome.refused == []
    return outcome.stored


def loaded_exactly(layers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> bool:
    k2, v2 = kv_of(layers, LAYOUT)
    return torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS])) and torch.equal(
        bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS])
    )


def object_at(client: StoreClient, key: str) -> tuple[int, bytes]:
    (replica,) = client.local_replicas([key])
    assert replica is not None
    return replica.address, ctypes.string_at(replica.address, replica.size)


# --- the digest ------------------------------------------------------------------------------


def test_the_cpu_and_device_implementations_of_the_keyed_digest_agree() -> None:
    g = torch.Generator().manual_seed(5)
    keys = [f"k{i}" for i in range(6)]
    payloads = torch.randint(0, 256, (6, 8 * 1500), dtype=torch.uint8, generator=g)
    lanes = gpu_digest.keys_tensor(keys, payloads.shape[1], torch.device("cpu"))
    objects = torch.zeros((6, payloads.shape[1] + CHECKSUM_BYTES), dtype=torch.uint8)
    gpu_digest.frame(payloads, lanes, objects)
    want = mac_digests(keys, [bytes(p.numpy()) for p in payloads])
    assert [bytes(o[-CHECKSUM_BYTES:].numpy()) for o in objects] == want
    assert all(is_mac(d) for d in want)
    back = torch.zeros_like(payloads)
    assert gpu_digest.unframe(objects, lanes, back).tolist() == [1] * 6
    assert torch.equal(back, payloads)


INTERPRETED = """
import torch
from workers.mooncake_store.digest import mac_digests
from workers.vllm_connector import gpu_digest

keys = ["a", "b", "c"]
unit = 8 * (gpu_digest.BLOCK * 2 + 3)  # several slices, a ragged last step
payloads = torch.randint(0, 256, (3, unit), dtype=torch.uint8)
lanes = gpu_digest.keys_tensor(keys, unit, torch.device("cpu"))
objects = torch.zeros((3, unit + 16), dtype=torch.uint8)
gpu_digest.frame(payloads, lanes, objects)
want = mac_digests(keys, [bytes(p.numpy()) for p in payloads])
assert [bytes(o[unit:].numpy()) for o in objects] == want
objects[1, 8 * 700 + 3] ^= 0x40
back = torch.zeros_like(payloads)
assert gpu_digest.unframe(objects, lanes, back).tolist() == [1, 0, 1]
assert torch.equal(back[0], payloads[0]) and not torch.equal(back[1], payloads[1])
print("agree")
"""


def test_the_triton_kernels_match_numpy_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    # in a fresh interpreter: triton's own library functions (`tl.sum`) are interpreted only
    # when TRITON_INTERPRET is set before triton is first imported
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "agree"


def test_verify_tells_the_kinds_apart_and_binds_the_key() -> None:
    payload = os.urandom(4096)
    (mac,) = mac_digests(["k"], [payload])
    assert verify("k", payload, mac) and verify("k", payload, checksum(payload))
    assert not verify("other", payload, mac)  # another key's object under this key fails
    # any single 64-bit word changed fails lane 0 alone (its multiplier is odd)
    words = np.frombuffer(payload, dtype="<u8").copy()
    for w in (0, 17, len(words) - 1):
        changed = words.copy()
        changed[w] ^= np.uint64(1 << 63)
        assert not verify("k", changed.tobytes(), mac)
    # a reserved object still all zeros never verifies (the tag is never 0)
    zeros = bytes(4096)
    assert not verify("k", zeros, bytes(CHECKSUM_BYTES))
    # an XXH3 digest that happens to end in the MAC's tag still verifies as XXH3
    rng = np.random.default_rng(7)
    while True:
        data = rng.bytes(64)
        if checksum(data)[-1] == MAC_TAG:
            break
    assert is_mac(checksum(data)) and verify("k", data, checksum(data))
    # a payload of a length not a multiple of 8 (CPU writers only)
    (odd,) = mac_digests(["k"], [payload[:1001]])
    assert verify("k", payload[:1001], odd) and not verify("k", payload[:1000], odd)


def test_strided_runs_are_consecutive_rows_at_one_stride() -> None:
    assert strided_runs([0, 1, 2, 3, 5, 6], [100, 200, 300, 400, 500, 600], 50) == [
        Run(0, 4, 100),
        Run(4, 2, 100),
    ]
    assert strided_runs([0, 1, 2], [100, 120, 300], 50) == [Run(0, 1, 50), Run(1, 2, 180)]
    assert strided_runs([3], [9], 5) == [Run(0, 1, 5)] and strided_runs([], [], 5) == []


# --- the store path ----------------------------------------------------------------------------


def test_a_zero_copy_save_and_load_round_trip_bit_exactly_with_keyed_digests(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        stored = save(w)
        assert len(stored) == HEADS * len(SRC_IDS)
        assert w.counts.saved_direct == len(stored) and w.counts.saved_through_store == 0
        # the objects are in this client's segment, payload then a keyed MAC
        key, unit, digest = stored[5]
        _, obj = object_at(client, key)
        assert obj[unit:] == digest and is_mac(digest) and verify(key, obj[:unit], digest)

        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        for _ in range(2):  # the second load answers the replicas from the cache
            result = r.load(rows_for(range(HEADS)), DST_IDS)
            assert (result.load.blocks, result.load.refused, result.dropped) == (4, None, [])
            assert loaded_exactly(layers, k, v)
        assert r.counts.loaded_direct == 2 * len(stored) and r.counts.loaded_through_store == 0

        # a save of blocks the store holds writes nothing and reports them stored
        again = w.put(w.gather(SRC_IDS), save_rows())  # type: ignore[arg-type]
        assert len(again.stored) == len(stored) and w.counts.saved_direct == len(stored)

        # TP=1 objects read by the two ranks of TP=2, each its own heads
        for rank in range(2):
            heads = heads_for_rank(HEADS, 2, rank)
            layers = nan_layers("cpu", len(heads), LAYOUT)
            tp = StoreKV(client, make_kv(layers), zero_copy=True)
            assert tp.load(rows_for(heads), DST_IDS).load.blocks == len(DST_IDS)
            part = slice(heads[0], heads[-1] + 1)
            k2, v2 = kv_of(layers, LAYOUT)
            assert torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS][..., part, :]))
            assert torch.equal(bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS][..., part, :]))
            tp.close()
        r.close()
        w.close()
    finally:
        client.close()


async def test_cpu_readers_read_what_the_zero_copy_path_wrote(master: MooncakeMaster) -> None:
    k, v = random_kv("cpu")
    writer = open_client(master)
    try:
        w = StoreKV(writer, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        stored = save(w)
        objects = {key: object_at(writer, key)[1] for key, _, _ in stored}
        # the CPU connector path (vLLM's CPU backend cache; get_split verifies on the CPU)
        shape = (10, HEADS, 16, 2 * 32)  # [blocks, kv_heads, block_size, 2 * head_size]
        cpu = CpuAttnKV([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)])
        unit = cpu.payload_nbytes
        reader = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
        try:
            r = StoreKV(reader, cpu)
            result = r.load(rows_for(range(HEADS)), DST_IDS)
            r.close()
        finally:
            reader.close()
        assert (result.load.blocks, result.dropped) == (len(DST_IDS), [])
        back = cpu.gather(DST_IDS).reshape(HEADS, len(DST_IDS), -1).view(torch.uint8)
        for i, row in enumerate(rows_for(range(HEADS))):
            for j, key in enumerate(row):
                assert bytes(back[j, i].numpy()) == objects[key][:unit]
        # the sidecar's store tier serves them with the XXH3 checksum its HTTP readers check
        tier = StoreTier.open(master.address, segment_bytes=16 << 20)
        try:
            key, unit, digest = stored[3]
            assert await tier.adopt([HeldArtifact(key, unit, digest)]) == [True]
            data, served = await tier.get(key)
            assert data == objects[key][:unit] and served == checksum(data) != digest
        finally:
            await asyncio.to_thread(tier.close)
        w.close()
    finally:
        writer.close()


def test_objects_in_another_clients_segment_are_read_and_written_through_the_store(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    other, mine = open_client(master), open_client(master)
    try:
        # saved by another engine: in its segment, not this process's memory
        w = StoreKV(other, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        save(w)
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(mine, make_kv(layers), zero_copy=True)
        assert mine.local_replicas(rows_for(range(HEADS))[0]) == [None] * HEADS
        result = r.load(rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.dropped) == (len(DST_IDS), [])
        assert loaded_exactly(layers, k, v)
        assert r.counts.loaded_direct == 0
        assert r.counts.loaded_through_store == HEADS * len(DST_IDS)
        r.close()
        w.close()
    finally:
        mine.close()
        other.close()
    # a writer whose own segment has no room: the master places the objects elsewhere, and
    # they go through registered staging with the same digests
    big, small = open_client(master, 64 << 20), open_client(master, 16 << 20)
    try:
        kv = make_kv(vllm_layers(k, v, LAYOUT))
        unit = kv.payload_nbytes
        filler = small.buffer(1 << 20)
        n = 0
        while small.put_from([f"fill{n}"], [filler.address], [(1 << 20) - 64]) == [0]:
            (where,) = small.local_replicas([f"fill{n}"])
            n += 1
            if where is None:  # the segment is full: this one went to the other client
                break
        assert n < 64, "the small segment never filled"
        w = StoreKV(small, kv, zero_copy=True)
        stored = save(w)
        assert len(stored) == HEADS * len(SRC_IDS) and w.counts.saved_through_store > 0
        assert all(is_mac(digest) for _, _, digest in stored)
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(big, make_kv(layers), zero_copy=True)
        assert r.load(rows_for(range(HEADS)), DST_IDS).load.blocks == len(DST_IDS)
        assert loaded_exactly(layers, k, v) and unit == stored[0][1]
        r.close()
        w.close()
        filler.close()
    finally:
        small.close()
        big.close()


def test_a_cached_replica_now_holding_another_keys_object_is_caught_and_read_afresh(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        stored = save(w)
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        assert r.load(rows_for(range(HEADS)), DST_IDS).load.blocks == len(DST_IDS)  # cached
        stale, _, _ = stored[9]
        address, obj = object_at(client, stale)
        # forced out by another client (readers' leases notwithstanding), its memory reused by
        # another key's object of the same size, the real object put again elsewhere
        remover = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
        try:
            assert remover.remove([stale]) == [True]
        finally:
            remover.close()
        intruder = bytearray(os.urandom(len(obj) - CHECKSUM_BYTES))
        intruder += mac_digests(["intruder"], [bytes(intruder)])[0]
        buf = client.buffer(2 * len(obj))
        buf.view[: len(obj)] = intruder
        buf.view[len(obj) : 2 * len(obj)] = obj
        assert client.put_objects(["intruder"], [buf.address], [len(obj)]) == [0]
        assert client.put_objects([stale], [buf.address + len(obj)], [len(obj)]) == [0]
        assert ctypes.string_at(address, len(obj)) == bytes(intruder)  # the cached address
        assert object_at(client, stale)[0] != address
        # a payload-only check would pass (the intruder's digest is valid); the keyed one fails
        payload, digest = bytes(intruder[:-CHECKSUM_BYTES]), bytes(intruder[-CHECKSUM_BYTES:])
        assert verify("intruder", payload, digest) and not verify(stale, payload, digest)

        for t in layers:
            t.fill_(float("nan"))
        before = r.counts.loaded_through_store
        result = r.load(rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.dropped) == (len(DST_IDS), [])
        assert loaded_exactly(layers, k, v)
        assert r.counts.loaded_through_store == before + 1
        buf.close()
        r.close()
        w.close()
    finally:
        client.close()


def test_an_object_corrupted_in_place_ends_the_good_prefix_and_leaves_the_store(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        save(w)
        bad = block_keys(MODEL, HASHES[2], [6])[0]
        address, _ = object_at(client, bad)
        ctypes.memset(address + 1000, 0x5A, 8)  # one word of the payload, in the store's memory
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        result = r.load(rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.dropped) == (2, [bad])
        assert result.load.refused is not None and "corrupted" in result.load.refused
        assert client.exists([bad]) == [False]  # removed: a later save writes it again
        k2, _ = kv_of(layers, LAYOUT)
        assert torch.equal(bits(k2[:, DST_IDS[:2]]), bits(k[:, SRC_IDS[:2]]))
        assert torch.isnan(k2[:, DST_IDS[2:]].float()).all()
        r.close()
        w.close()
    finally:
        client.close()


def test_zero_copy_needs_a_segment_of_its_own(master: MooncakeMaster) -> None:
    k, v = random_kv("cpu")
    client = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
    try:
        kv = make_kv(vllm_layers(k, v, LAYOUT))
        with pytest.raises(ValueError, match="own segment"):
            StoreKV(client, kv, zero_copy=True)
        skv = StoreKV(client, kv)  # by default, off on CPU tensors and without a segment
        assert not skv.zero_copy
        skv.close()
    finally:
        client.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_on_a_gpu_the_zero_copy_path_round_trips_through_the_registered_segment(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cuda")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)))
        assert w.zero_copy and isinstance(w.kv, CudaPagedKV)
        stored = save(w)
        for key, unit, digest in stored[:3]:
            _, obj = object_at(client, key)
            assert obj[unit:] == digest and verify(key, obj[:unit], digest)  # numpy agrees
        layers = nan_layers("cuda", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers))
        result = r.load(rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.dropped) == (len(DST_IDS), [])
        assert loaded_exactly(layers, k, v)
        assert r.counts.loaded_direct == len(stored)
        r.close()
        w.close()
    finally:
        client.close()
