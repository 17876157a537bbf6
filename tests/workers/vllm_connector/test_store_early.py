"""The master's round trips asked for before a transfer (`StoreKV.reserve` / `reserve_groups` /
`reserve_rows` for saves, `StoreKV.resolve` for loads), against a real `mooncake_master` on CPU
tensors (zero copy: copies by `memmove`): a save handed its reservations asks the master for
nothing more and stores the same objects; reservations a save did not take are removed; a
resolved load makes no lookup of its own and loads bit-exactly, TP 1 -> 2 included; a resolved
address gone stale (the object removed, its memory holding another key's object) is caught by
the keyed digest and read afresh, or ends the good prefix when the object is gone. The device
run is `bench/kernels/connector_store_paths.py`."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
import torch

from ownerserve.kvstate.heads import heads_for_rank
from tests.workers.vllm_connector.test_gpu_path import (
    DST_IDS,
    HEADS,
    SRC_IDS,
    kv_of,
    make_kv,
    nan_layers,
    random_kv,
    vllm_layers,
)
from tests.workers.vllm_connector.test_store_groups import (
    GROUP,
    LAYOUT,
    bits,
    groups,
    loaded,
    master,
    open_client,
)
from tests.workers.vllm_connector.test_store_zero_copy import rows_for, save_rows
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    ClientSettings,
    MooncakeMaster,
    StoreClient,
    verify,
)
from workers.mooncake_store.digest import mac_digests
from workers.vllm_connector.plan import head_range
from workers.vllm_connector.store_path import StoreKV

__all__ = ["master"]  # the fixture, imported


class Counting:
    """The store's binding with its master calls counted by name."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if not callable(real):
            return real

        def call(*a: Any, **k: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*a, **k)

        return call


def counting(client: StoreClient) -> Counting:
    c = Counting(client._store)
    client._store = c
    return c


def test_a_grouped_save_reserved_at_bind_asks_nothing_more_and_stores_the_same_objects(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        plain = w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        client.remove([g.key for g in gs])
        early = w.reserve_groups(gs)  # the step bound: its saves known
        for f in early.futures:
            f.result()  # the forward pass ran meanwhile
        calls = counting(client)
        staged = w.gather(SRC_IDS, groups=gs, reserving=early)
        assert staged is not None and staged.reserving is early
        out = w.put_groups(staged, gs)
        assert calls.calls.get("batch_put_session_start", 0) == 0
        assert out.refused == [] and out.stored == plain.stored
        for key, nbytes, digest in out.stored:
            (replica,) = client.local_replicas([key])
            assert replica is not None
            obj = ctypes.string_at(replica.address, replica.size)
            assert obj[nbytes:] == digest and verify(key, obj[:nbytes], digest)
        # a reservation that does not match the save is given back and asked afresh
        client.remove([g.key for g in gs])
        wrong = w.reserve(["not-this-save"], [4096])
        for f in wrong.futures:
            f.result()
        assert client.exists(["not-this-save"]) == [True]
        out = w.put_groups(w.gather(SRC_IDS, groups=gs, reserving=wrong), gs)  # type: ignore[arg-type]
        assert out.stored == plain.stored
        assert client.exists(["not-this-save"]) == [False]
        # one dropped before its gather: cancelled, nothing left reserved
        client.remove([g.key for g in gs])
        dropped = w.reserve_groups(gs)
        dropped.cancel(client)
        assert client.exists([g.key for g in gs]) == [False, False]
        w.close()
    finally:
        client.close()


def test_a_per_head_save_reserved_at_bind_uses_its_reservations(master: MooncakeMaster) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        early = w.reserve_rows(save_rows())
        for f in early.futures:
            f.result()
        calls = counting(client)
        out = w.put(w.gather(SRC_IDS, reserving=early), save_rows())  # type: ignore[arg-type]
        assert out.refused == [] and len(out.stored) == HEADS * len(SRC_IDS)
        assert calls.calls.get("batch_put_session_start", 0) == 0 and early.taken
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        r.resolve([key for row in rows_for(range(HEADS)) for key in row])
        result = r.load(rows_for(range(HEADS)), DST_IDS)
        assert (result.load.blocks, result.dropped) == (len(DST_IDS), [])
        assert r.counts.loaded_through_store == 0
        r.close()
        w.close()
    finally:
        client.close()


def test_a_resolved_grouped_load_makes_no_lookup_and_loads_bit_exactly(
    master: MooncakeMaster,
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        client.forget_local([g.key for g in gs])
        for gated in (True, False):
            layers = nan_layers("cpu", HEADS, LAYOUT)
            r = StoreKV(client, make_kv(layers), zero_copy=True)
            r.gated_load = gated
            r.resolve([g.key for g in gs])  # the hit decided, a step before the load
            r._resolving[gs[0].key].result()
            calls = counting(client)
            result = r.load_groups(gs, DST_IDS)
            client._store = calls._store
            assert calls.calls.get("batch_get_replica_desc", 0) == 0
            assert (result.load.blocks, result.load.refused, result.dropped) == (4, None, [])
            assert loaded(layers, k, v, slice(None)) and r.counts.loaded_through_store == 0
            assert r._resolving == {}
            r.close()
            client.forget_local([g.key for g in gs])
        for rank in range(2):  # TP=1 objects, each TP=2 rank resolving its load
            lo, hi = head_range(heads_for_rank(HEADS, 2, rank))
            layers = nan_layers("cpu", hi - lo, LAYOUT)
            tp = StoreKV(client, make_kv(layers), zero_copy=True)
            tp.resolve([g.key for g in gs])
            result = tp.load_groups(gs, DST_IDS, object_heads=HEADS, first_head=lo)
            assert (result.load.blocks, result.load.refused) == (4, None)
            assert loaded(layers, k, v, slice(lo, hi))
            tp.close()
        w.close()
    finally:
        client.close()


@pytest.mark.parametrize("put_again", [True, False])
def test_a_resolved_address_gone_stale_is_caught_and_looked_up_afresh(
    master: MooncakeMaster, put_again: bool
) -> None:
    k, v = random_kv("cpu")
    client = open_client(master)
    try:
        w = StoreKV(client, make_kv(vllm_layers(k, v, LAYOUT)), zero_copy=True)
        gs = groups()
        w.put_groups(w.gather(SRC_IDS, groups=gs), gs)  # type: ignore[arg-type]
        layers = nan_layers("cpu", HEADS, LAYOUT)
        r = StoreKV(client, make_kv(layers), zero_copy=True)
        r.resolve([g.key for g in gs])
        r._resolving[gs[0].key].result()  # resolved: the addresses cached
        stale = gs[1].key
        (replica,) = client.local_replicas([stale])
        assert replica is not None
        address, size = replica.address, replica.size
        obj = ctypes.string_at(address, size)
        # between the lookup and the load: the object removed, its memory holding another
        # key's object of the same size (valid digest, keyed to that key), and maybe the
        # object put again elsewhere
        remover = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
        try:  # another client (this one's own removes forget what it cached)
            assert remover.remove([stale]) == [True]
        finally:
            remover.close()
        intruder = bytearray(os.urandom(size - CHECKSUM_BYTES))
        intruder += mac_digests(["intruder"], [bytes(intruder)])[0]
        buf = client.buffer(2 * size)
        buf.view[:size] = intruder
        buf.view[size : 2 * size] = obj
        assert client.put_objects(["intruder"], [buf.address], [size]) == [0]
        if put_again:
            assert client.put_objects([stale], [buf.address + size], [size]) == [0]
        else:  # the cached address holds the intruder either way
            ctypes.memmove(address, bytes(intruder), size)
        assert ctypes.string_at(address, size) == bytes(intruder)

        result = r.load_groups(gs, DST_IDS)
        k2, _ = kv_of(layers, LAYOUT)
        if put_again:  # read afresh: every block, bit-exact
            assert (result.load.blocks, result.load.refused, result.dropped) == (4, None, [])
            assert loaded(layers, k, v, slice(None))
            assert r.counts.loaded_through_store == 1
        else:  # gone: the good prefix ends before it, nothing of it written
            assert result.load.blocks == GROUP and result.dropped == [stale]
            assert result.load.refused is not None and "missing" in result.load.refused
            assert torch.equal(bits(k2[:, DST_IDS[:GROUP]]), bits(k[:, SRC_IDS[:GROUP]]))
            assert torch.isnan(k2[:, DST_IDS[GROUP:]]).all()
        buf.close()
        r.close()
        w.close()
    finally:
        client.close()
