"""The store client against a real master: artifacts round-trip byte for byte through
registered memory with their digest, a missing or corrupted object reads as such, a master
that is gone fails the call at once."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from ownerserve.ports import free_port
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    CORRUPTED,
    MISSING,
    ClientSettings,
    MasterAddress,
    MooncakeMaster,
    StoreClient,
    StoreFull,
    StoreUnavailable,
    checksum,
)


def put_when_mounted(client: StoreClient, key: str, address: int, size: int) -> list[int]:
    """Put once the client's segment is mounted on the master again (its next heartbeat, ~1 s):
    until then the store has no room anywhere (`StoreFull`). Bounded at 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return client.put_from([key], [address], [size])
        except (StoreFull, StoreUnavailable):
            if time.monotonic() > deadline:
                raise


@pytest.fixture
def client(master: MooncakeMaster) -> Iterator[StoreClient]:
    c = StoreClient.open(ClientSettings(master.address, segment_bytes=64 << 20))
    try:
        yield c
    finally:
        c.close()


def test_put_from_and_get_into_round_trip(client: StoreClient) -> None:
    payloads = [os.urandom(n) for n in (1, 4096, 1 << 20)]
    src = client.buffer(4 << 20)
    dst = client.buffer(4 << 20)
    addrs, offset = [], 0
    for p in payloads:
        src.view[offset : offset + len(p)] = p
        addrs.append(src.address + offset)
        offset += len(p) + CHECKSUM_BYTES
    keys = [f"k{i}" for i in range(len(payloads))]
    assert client.put_from(keys, addrs, [len(p) for p in payloads]) == [0, 0, 0]
    # the digest went right after each payload
    assert bytes(src.view[len(payloads[0]) : len(payloads[0]) + 16]) == checksum(payloads[0])
    caps = [len(p) + CHECKSUM_BYTES for p in payloads]
    daddrs = [dst.address + sum(caps[:i]) for i in range(len(caps))]
    assert client.get_into(keys, daddrs, caps) == [len(p) for p in payloads]
    for p, a in zip(payloads, daddrs, strict=True):
        start = a - dst.address
        assert bytes(dst.view[start : start + len(p)]) == p
    assert client.exists([*keys, "nope"]) == [True, True, True, False]
    assert client.sizes(["k1", "nope"]) == [4096, MISSING]
    src.close()
    dst.close()


def test_missing_and_corrupted_objects_read_as_such(client: StoreClient) -> None:
    buf = client.buffer(1 << 20)
    client.put("good", b"x" * 100)
    assert client.put_raw("foreign", b"y" * 100) == 0  # no digest of its own: fails it
    got = client.get_into(
        ["good", "foreign", "absent"],
        [buf.address, buf.address + 200, buf.address + 400],
        [200] * 3,
    )
    assert got == [100, CORRUPTED, MISSING]
    assert client.remove(["good", "absent"]) == [True, False]
    assert client.get_into(["good"], [buf.address], [200]) == [MISSING]
    buf.close()


def test_open_without_a_master_fails_at_once() -> None:
    nowhere = MasterAddress("127.0.0.1", free_port(), free_port())
    with pytest.raises(StoreUnavailable, match="no Mooncake master answers"):
        StoreClient.open(ClientSettings(nowhere, segment_bytes=0))


def test_master_killed_fails_gets_then_restart_serves_puts(
    master: MooncakeMaster, client: StoreClient
) -> None:
    buf = client.buffer(1 << 20)
    client.put("before", b"b" * 64)
    master.kill()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        client.get_into(["before"], [buf.address], [100])
    master.start()  # same ports: the client finds it again and mounts its segment anew
    buf.view[:10] = b"0123456789"
    assert put_when_mounted(client, "after", buf.address, 10) == [0]
    assert client.get_into(["after", "before"], [buf.address + 4096] * 2, [100] * 2) == [
        10,
        MISSING,  # what the old master knew is gone with it
    ]
    buf.close()


def test_split_puts_and_gets_store_the_same_objects_and_refuse_another_size(
    client: StoreClient,
) -> None:
    """`put_split` / `get_split` (payloads back to back, digests apart) write and read the
    objects `put_from` / `get_into` do; an object of another size, or failing its digest, is
    refused."""
    payloads = [os.urandom(5000) for _ in range(3)]
    src, dst = client.buffer(1 << 20), client.buffer(1 << 20)
    for i, p in enumerate(payloads):
        src.view[i * 5000 : (i + 1) * 5000] = p
    digests = [src.address + 20000 + 16 * i for i in range(3)]
    keys = ["s0", "s1", "s2"]
    addrs = [src.address + 5000 * i for i in range(3)]
    assert client.put_split(keys, addrs, [5000] * 3, digests) == [0, 0, 0]
    # read back whole: the payload, then its digest
    assert client.get_into(keys[:1], [dst.address], [5016]) == [5000]
    assert bytes(dst.view[:5016]) == payloads[0] + checksum(payloads[0])
    # and split, also of an object put_from wrote
    src.view[30000:31000] = payloads[1][:1000]
    assert client.put_from(["whole"], [src.address + 30000], [1000]) == [0]
    got = client.get_split(
        [*keys, "whole"],
        [dst.address + 5000 * i for i in range(3)] + [dst.address + 15000],
        [5000, 5000, 5000, 1000],
        [dst.address + 20000 + 16 * i for i in range(4)],
    )
    assert got == [5000, 5000, 5000, 1000]
    assert bytes(dst.view[:15000]) == b"".join(payloads)
    assert bytes(dst.view[20048:20064]) == checksum(payloads[1][:1000])
    # refused: absent, larger and smaller than asked, a payload not matching its digest
    assert client.put_raw("bad", bytes(5016)) == 0
    slots = [dst.address + 5000 * i for i in range(4)]
    digest_slots = [dst.address + 20000 + 16 * i for i in range(4)]
    got = client.get_split(
        ["absent", "s0", "whole", "bad"], slots, [5000, 4000, 2000, 5000], digest_slots
    )
    assert got == [MISSING, CORRUPTED, MISSING, CORRUPTED]
    src.close()
    dst.close()


def test_cached_replicas_serve_repeat_reads_and_a_moved_one_is_read_afresh(
    master: MooncakeMaster, client: StoreClient
) -> None:
    """With `replica_cache_s` a read object's replica is cached (a get session) and the next
    reads skip the master's lookup; when the object is removed and another of the same size
    takes its memory, the cached replica would read the other's bytes (with a valid digest of
    their own): checked against the key's first digest, the read goes to the master instead and
    answers missing. (A cached read may still return a removed object's own bytes, verified,
    while its memory holds them: keys name their bytes.)"""
    reader = StoreClient.open(ClientSettings(master.address, segment_bytes=0, replica_cache_s=60))
    try:
        size = 4096
        src, dst = client.buffer(1 << 16), reader.buffer(1 << 16)
        src.view[:size] = b"A" * size
        assert client.put_from(["a"], [src.address], [size]) == [0]
        for _ in range(3):  # noted, cached, read from the cache
            dst.view[:size] = bytes(size)
            assert reader.get_into(["a"], [dst.address], [size + CHECKSUM_BYTES]) == [size]
            assert bytes(dst.view[:size]) == b"A" * size
        assert "a" in reader._replicas
        digests = [dst.address + 60000]
        assert reader.get_split(["a"], [dst.address], [size], digests) == [size]

        assert client.remove(["a"]) == [True]  # another client's removal: the reader's cache
        src.view[:size] = b"B" * size  # still names the old replica, now "b"'s memory
        assert client.put_from(["b"], [src.address], [size]) == [0]
        assert reader.get_into(["a"], [dst.address], [size + CHECKSUM_BYTES]) == [MISSING]
        assert "a" not in reader._replicas
        # the same through get_split, cached anew from a fresh put of "a"
        src.view[:size] = b"A" * size
        assert client.put_from(["a"], [src.address], [size]) == [0]
        for _ in range(3):
            assert reader.get_split(["a"], [dst.address], [size], digests) == [size]
        assert "a" in reader._replicas
        assert client.remove(["a", "b"]) == [True, True]
        src.view[:size] = b"C" * size
        assert client.put_from(["c"], [src.address], [size]) == [0]
        dst.view[:size] = bytes(size)
        got = reader.get_split(["a"], [dst.address], [size], digests)
        # "c" may or may not have taken "a"'s old memory: either the read misses, or the old
        # bytes still there are "a"'s own, verified; never "c"'s
        assert got == [MISSING] or (got == [size] and bytes(dst.view[:size]) == b"A" * size)
        src.close()
        dst.close()
    finally:
        reader.close()
