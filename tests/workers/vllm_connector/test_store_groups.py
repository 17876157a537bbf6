"""The store path's grouped layout (`StoreKV.put_groups` / `load_groups`, `plan.object_groups`):
one object per group of blocks holding every KV head, one digest after it. Pure layout on its
own; the store path against a real `mooncake_master` on CPU tensors (zero copy: copies by
`memmove`, the keyed digest in numpy; and through the store's own calls): round trips
bit-exact, TP 1 -> 2 bit-exact (each rank reads whole objects and takes its heads), CPU readers
verifying the objects by `digest.verify`, a corrupted object ending the good prefix, the
reservations of a save dropped before its put removed. The device run is
`bench/kernels/connector_store.py`."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
    verify,
)
from workers.mooncake_store.digest import is_mac, mac_digests
from workers.vllm_connector import gpu_digest
from workers.vllm_connector.plan import (
    ObjectGroup,
    group_key,
    head_range,
    object_groups,
)
from workers.vllm_connector.store_path import StoreKV, chunk_bounds

LAYOUT = "flashattn"
ROOT = Path(__file__).resolve().parents[3]

# --- the layout, pure ------------------------------------------------------------------------


def test_groups_are_cut_at_the_requests_multiples_so_saves_and_loads_cut_alike() -> None:
    hashes = list(range(100, 120))
    whole = object_groups("m", 0, hashes, 8, 8)
    assert [(g.first, g.count) for g in whole] == [(0, 8), (8, 8), (16, 4)]
    # a save of blocks [5, 20): its first object ends at the request's block 8
    later = object_groups("m", 5, hashes[5:], 8, 8)
    assert [(g.first, g.count) for g in later] == [(0, 3), (3, 8), (11, 4)]
    # the full group [8, 16) has the same key whichever save wrote it
    assert later[1].key == whole[1].key == group_key("m", hashes[15], 8, 8)
    # a partial group is another object than the full one ending on the same block
    assert group_key("m", 7, 3, 8) != group_key("m", 7, 8, 8)
    assert object_groups("m", 3, [], 8, 8) == []
    with pytest.raises(ValueError):
        object_groups("m", 0, hashes, 8, 0)


def test_a_group_key_names_model_blocks_heads_stage_and_the_last_chain_hash() -> None:
    key = group_key("llama", 0xABC, 8, 4, pp_rank=1, layers=(0, 16))
    assert key == "llama@blocks:8@heads:4@pp_rank:1@0000000000000abc@layers:0-16"
    assert group_key("llama", 0xABC, 8, 8) != group_key("llama", 0xABC, 8, 4)
    with pytest.raises(ValueError):
        group_key("llama", 1, 0, 8)


def test_a_ranks_heads_are_one_contiguous_range_of_the_objects_heads() -> None:
    assert head_range(heads_for_rank(8, 2, 1)) == (4, 8)
    assert head_range(heads_for_rank(8, 4, 0)) == (0, 2)
    assert head_range(heads_for_rank(2, 4, 3)) == (1, 2)  # replicated heads: one each
    with pytest.raises(ValueError):
        head_range([0, 2])


def test_round_trip_chunks_start_small_and_double() -> None:
    assert chunk_bounds(8, 1, 64) == [(0, 1), (1, 3), (3, 7), (7, 8)]
    assert chunk_bounds(8, 8, 8) == [(0, 8)]
    assert chunk_bounds(5, 1, 2) == [(0, 1), (1, 3), (3, 5)]
    assert chunk_bounds(0, 1, 8) == []


# --- the digest, read in place --------------------------------------------------------------


def test_digests_read_in_place_are_the_framed_ones_and_check_binds_them() -> None:
    g = torch.Generator().manual_seed(7)
    keys = [f"g{i}" for i in range(3)]
    payloads = torch.randint(0, 256, (3, 8 * 900), dtype=torch.uint8, generator=g)
    lanes = gpu_digest.keys_tensor(keys, payloads.shape[1], torch.device("cpu"))
    out = torch.zeros((3, CHECKSUM_BYTES), dtype=torch.uint8)
    gpu_digest.digests(payloads, lanes, out)
    want = mac_digests(keys, [bytes(p.numpy()) for p in payloads])
    assert [bytes(d.numpy()) for d in out] == want
    assert gpu_digest.check(payloads, lanes, out).tolist() == [1, 1, 1]
    payloads[2, 77] ^= 0x10
    out[0, 3] ^= 0x01
    assert gpu_digest.check(payloads, lanes, out).tolist() == [0, 1, 0]


INTERPRETED = """
import torch
from workers.mooncake_store.digest import mac_digests
from workers.vllm_connector import gpu_digest

keys = ["a", "b", "c"]
unit = 8 * (gpu_digest.BLOCK * 2 + 3)  # several slices, a ragged last step
payloads = torch.randint(0, 256, (3, unit), dtype=torch.uint8)
lanes = gpu_digest.keys_tensor(keys, unit, torch.device("cpu"))
out = torch.zeros((3, 16), dtype=torch.uint8)
gpu_digest.digests(payloads, lanes, out)
want = mac_digests(keys, [bytes(p.numpy()) for p in payloads])
assert [bytes(d.numpy()) for d in out] == want
payloads[1, 8 * 700 + 3] ^= 0x40
assert gpu_digest.check(payloads, lanes, out).tolist() == [1, 0, 1]
print("agree")
"""


def test_the_in_place_triton_kernels_match_numpy_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "agree"


# --- through a real master -------------------------------------------------------------------


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


GROUP = 3  # 4 blocks: a full group and a partial one


def groups(heads: int = HEADS) -> list[ObjectGroup]:
    return object_groups(MODEL, 0, HASHES, heads, GROUP)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def loaded(layers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, part: slice) -> bool:
    k2, v2 = (t.cpu() for t in kv_of(layers, LAYOUT))
    return torch.equal(bits(k2[:, DST_IDS]), bits(k[:, SRC_IDS][..., part, :])) and torch.equal(
        bits(v2[:, DST_IDS]), bits(v[:, SRC_IDS][..., part, :])
    )


CUDA = torch.cuda.is_available()
PATHS = [
    ("cpu", True),
    ("cpu", False),
    pytest.param(
        "cuda",
        True,
        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")],
    ),
    pytest.param(
        "cuda",
        False,
        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.parametrize(("device", "zero_copy"), PATHS)
def test_grouped_objects_round_trip_bit_exactly_and_tp2_ranks_take_their_heads(
    master: MooncakeMaster, device: str, zero_copy: bool
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        src = vllm_layers(k.to(device), v.to(device), LAYOUT)
        w = StoreKV(client, make_kv(src), zero_copy=zero_copy)
        gs = groups()
        staged = w.gather(SRC_IDS, groups=gs)
        assert staged is not None and staged.on_device == zero_copy
        out = w.put_groups(staged, gs)
        assert out.refused == [] and [s[0] for s in out.stored] == [g.key for g in gs]
        if zero_copy:
            assert w.counts.saved_direct == 2 and w.counts.saved_through_store == 0
        # each object: the blocks' payloads, every head, block after block, then one digest
        unit = w.kv.payload_nbytes
        gathered = w.kv.device_gather(SRC_IDS)  # type: ignore[attr-defined]
        expect = gathered.reshape(-1).cpu().numpy().tobytes()
        for (key, nbytes, digest), g in zip(out.stored, gs, strict=True):
            (replica,) = client.local_replicas([key])
            assert replica is not None and replica.size == nbytes + CHECKSUM_BYTES
            obj = ctypes.string_at(replica.address, replica.size)
            lo = g.first * HEADS * unit
            assert obj[:nbytes] == expect[lo : lo + nbytes] and obj[nbytes:] == digest
            assert verify(key, obj[:nbytes], digest) and is_mac(digest) == zero_copy
            if zero_copy:  # the keyed MAC binds the object to its key (XXH3 does not)
                other = gs[0].key if key != gs[0].key else gs[1].key
                assert not verify(other, obj[:nbytes], digest)

        layers = nan_layers(device, HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=zero_copy)
        for _ in range(2):  # the second zero-copy load answers the replicas from the cache
            result = r.load_groups(gs, DST_IDS)
            assert (result.load.blocks, result.load.refused, result.dropped) == (4, None, [])
            assert loaded(layers, k, v, slice(None))
        r.close()

        # TP=1 objects read by the two ranks of TP=2: whole objects, each rank its heads
        for rank in range(2):
            lo, hi = head_range(heads_for_rank(HEADS, 2, rank))
            layers = nan_layers(device, hi - lo, LAYOUT)
            tp = StoreKV(client, make_kv(layers), zero_copy=zero_copy)
            result = tp.load_groups(gs, DST_IDS, object_heads=HEADS, first_head=lo)
            assert (result.load.blocks, result.load.refused) == (4, None)
            assert loaded(layers, k, v, slice(lo, hi))
            tp.close()
        w.close()
    finally:
        client.close()


@pytest.mark.parametrize(("save_slots", "gated_load"), [(True, True), (False, False)])
def test_the_slot_and_gated_paths_store_and_load_what_the_launch_by_launch_ones_do(
    master: MooncakeMaster, save_slots: bool, gated_load: bool
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        w.save_slots = save_slots
        gs = groups()
        for _ in range(2):  # the second save reuses the shape's slot
            client.remove([g.key for g in gs])
            staged = w.gather(SRC_IDS, groups=gs)
            assert staged is not None
            assert (staged.digests.numel() > 0) == save_slots  # digests with the gather
            out = w.put_groups(staged, gs)
            assert out.refused == [] and w.counts.saved_through_store == 0
            for key, nbytes, digest in out.stored:
                (replica,) = client.local_replicas([key])
                assert replica is not None
                obj = ctypes.string_at(replica.address, replica.size)
                assert obj[nbytes:] == digest and verify(key, obj[:nbytes], digest)
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        r.gated_load = gated_load
        for _ in range(2):
            for t in layers:
                t.fill_(float("nan"))
            result = r.load_groups(gs, DST_IDS)
            assert (result.load.blocks, result.load.refused, result.dropped) == (4, None, [])
            assert loaded(layers, k, v, slice(None))
        r.close()
        w.close()
    finally:
        client.close()


def test_grouped_objects_in_another_clients_segment_are_read_through_the_store(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    other, mine = open_client(master), open_client(master)
    try:
        w = StoreKV(other, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        lo, hi = head_range(heads_for_rank(HEADS, 2, 1))
        layers = nan_layers("cpu", hi - lo, LAYOUT)
        r = StoreKV(mine, make_kv(layers), zero_copy=True)
        result = r.load_groups(gs, DST_IDS, object_heads=HEADS, first_head=lo)
        assert (result.load.blocks, result.dropped) == (4, [])
        assert loaded(layers, k, v, slice(lo, hi))
        assert r.counts.loaded_direct == 0 and r.counts.loaded_through_store == 2
        r.close()
        w.close()
    finally:
        other.close()
        mine.close()


def test_a_corrupted_grouped_object_ends_the_good_prefix_and_leaves_the_store(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        (replica,) = client.local_replicas([gs[1].key])
        assert replica is not None
        byte = ctypes.c_uint8.from_address(replica.address + 100)
        byte.value ^= 0x01  # one bit of the second object's payload
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        result = r.load_groups(gs, DST_IDS)
        assert result.load.blocks == GROUP and result.dropped == [gs[1].key]
        assert result.load.refused is not None and "corrupted" in result.load.refused
        k2, _ = kv_of(layers, LAYOUT)
        assert torch.equal(bits(k2[:, DST_IDS[:GROUP]]), bits(k[:, SRC_IDS[:GROUP]]))
        assert torch.isnan(k2[:, DST_IDS[GROUP:]]).all()  # nothing of the refused group
        assert client.exists([gs[0].key, gs[1].key]) == [True, False]
        r.close()
        w.close()
    finally:
        client.close()


def test_a_grouped_save_dropped_before_its_put_leaves_no_reserved_object(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        staged = w.gather(SRC_IDS, groups=gs)
        assert staged is not None and staged.reserving is not None
        for f in staged.reserving.futures:
            f.result()
        assert client.exists([g.key for g in gs]) == [True, True]  # reserved, all zeros
        del staged
        gc.collect()
        assert client.exists([g.key for g in gs]) == [False, False]
        # and a save then goes through whole
        out = w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        assert out.refused == [] and w.counts.saved_direct == 2
        w.close()
    finally:
        client.close()
