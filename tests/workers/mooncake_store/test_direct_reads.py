"""Batch gets with `direct_reads` against a real master: objects read where their replicas lie
(neighbours in one transfer) arrive byte for byte in their slots, and what such a read cannot
take (an object missing, failing its digest, larger than its slot) is answered as the store's
own get answers it; a batch read again within `replica_cache_s` skips the lookup, and one whose
replica moved since is read afresh."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from workers.mooncake_store import (
    CHECKSUM_BYTES,
    CORRUPTED,
    MISSING,
    ClientSettings,
    MooncakeMaster,
    StoreClient,
)


@pytest.fixture
def writer(master: MooncakeMaster) -> Iterator[StoreClient]:
    c = StoreClient.open(ClientSettings(master.address, segment_bytes=64 << 20))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def reader(master: MooncakeMaster) -> Iterator[StoreClient]:
    """A client with no segment of its own: every object it reads lies in the writer's."""
    c = StoreClient.open(ClientSettings(master.address, segment_bytes=0, direct_reads=True))
    try:
        yield c
    finally:
        c.close()


def put_batch(writer: StoreClient, keys: list[str], payloads: list[bytes]) -> None:
    stride = max(len(p) for p in payloads) + CHECKSUM_BYTES
    src = writer.buffer(stride * len(keys))
    for i, p in enumerate(payloads):
        src.view[i * stride : i * stride + len(p)] = p
    addrs = [src.address + i * stride for i in range(len(keys))]
    assert writer.put_from(keys, addrs, [len(p) for p in payloads]) == [0] * len(keys)
    src.close()


def test_a_batch_is_read_where_it_lies_neighbours_together_byte_for_byte(
    writer: StoreClient, reader: StoreClient
) -> None:
    small = [os.urandom(4096) for _ in range(64)]
    large = [os.urandom(128 << 10) for _ in range(2)]  # read alone, straight into its slot
    put_batch(writer, [f"s{i}" for i in range(64)], small)
    put_batch(writer, ["l0", "l1"], large)
    payloads = [*small, *large]
    keys = [*(f"s{i}" for i in range(64)), "l0", "l1"]
    # slots of another layout than the writer's segment
    caps = [8192] * 64 + [(128 << 10) + 4096] * 2
    dst = reader.buffer(sum(caps))
    addrs = [dst.address + sum(caps[:i]) for i in range(len(keys))]
    got = reader.get_into(keys, addrs, caps)
    assert got == [len(p) for p in payloads]
    for p, a in zip(payloads, addrs, strict=True):
        start = a - dst.address
        assert bytes(dst.view[start : start + len(p)]) == p
    assert reader.direct_objects == len(keys)  # none through the store's own get
    assert reader.direct_transfers < len(keys) // 4  # the small ones shared transfers
    dst.close()


def test_what_a_direct_read_cannot_take_is_answered_as_the_store_answers_it(
    writer: StoreClient, reader: StoreClient
) -> None:
    put_batch(writer, ["good", "big"], [b"g" * 100, b"b" * 5000])
    assert writer.put_raw("foreign", b"y" * 100) == 0  # no digest of its own: fails it
    dst = reader.buffer(1 << 20)
    keys = ["good", "foreign", "absent", "big"]
    addrs = [dst.address + i * 8192 for i in range(len(keys))]
    caps = [200, 200, 200, 200]  # "big" does not fit its slot: not the artifact listed
    assert reader.get_into(keys, addrs, caps) == [100, CORRUPTED, MISSING, CORRUPTED]
    assert bytes(dst.view[:100]) == b"g" * 100
    assert writer.remove(["good"]) == [True]
    assert reader.get_into(["good", "foreign"], addrs[:2], caps[:2]) == [MISSING, CORRUPTED]
    dst.close()


def test_a_batch_read_again_needs_no_lookup_and_a_moved_replica_is_read_afresh(
    master: MooncakeMaster, writer: StoreClient
) -> None:
    reader = StoreClient.open(
        ClientSettings(master.address, segment_bytes=0, direct_reads=True, replica_cache_s=60)
    )
    try:
        size = 4096
        put_batch(writer, ["a", "b"], [b"A" * size, b"B" * size])
        dst = reader.buffer(1 << 16)
        addrs, caps = [dst.address, dst.address + 8192], [size + CHECKSUM_BYTES] * 2
        for _ in range(3):
            assert reader.get_into(["a", "b"], addrs, caps) == [size, size]
        assert reader.direct_lookups == 1 and reader.direct_objects == 6
        # another client's removal, then another object of the same size in "a"'s memory
        assert writer.remove(["a"]) == [True]
        put_batch(writer, ["c"], [b"C" * size])
        dst.view[: 2 * 8192] = bytes(2 * 8192)
        got = reader.get_into(["a", "b"], addrs, caps)
        # "c" may or may not have taken "a"'s old memory: either "a" misses, or the old bytes
        # still there are "a"'s own, verified; never "c"'s
        assert got[1] == size and bytes(dst.view[8192 : 8192 + size]) == b"B" * size
        assert got[0] == MISSING or (got[0] == size and bytes(dst.view[:size]) == b"A" * size)
        if got[0] == MISSING:
            assert "a" not in reader._located
        dst.close()
    finally:
        reader.close()
