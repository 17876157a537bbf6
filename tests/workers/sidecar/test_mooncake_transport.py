"""The Mooncake Transfer Engine sidecar transport over the real engine (TCP protocol, P2P
handshake) on loopback: round trips, many keys through a small staging buffer, missing keys,
checksum mismatches, a stopped peer, and a peer sidecar process killed (SIGKILL) mid-transfer.
Skipped, with the reason, where `mooncake.engine` does not import."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from tests.waiting import BOUND_S
from tests.workers.sidecar.test_transport import (
    assert_fetches_every_payload,
    assert_only_whole_artifacts,
    fetch_as_the_owner_is_killed,
)
from workers.sidecar import mooncake_transport as mt
from workers.sidecar.arena import Arena
from workers.sidecar.store import ArtifactStore, checksum
from workers.sidecar.transport import TransferError
from workers.sidecar.transport import TransportServer as TcpTransportServer
from workers.sidecar.transports import select_transport

pytestmark = pytest.mark.skipif(
    not mt.AVAILABLE, reason=f"Mooncake Transfer Engine unavailable: {mt.UNAVAILABLE_REASON}"
)

SMALL_STAGING = mt.MooncakeSettings(
    staging_bytes=256 << 10, region_bytes=64 << 10, in_place_bytes=512 << 10
)


async def _soon(cond: Callable[[], bool], timeout_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return cond()


def _store() -> ArtifactStore:
    return ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False)


def _arena_store(arena_bytes: int = 64 << 20) -> ArtifactStore:
    return ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False, arena=Arena(arena_bytes))


@contextlib.asynccontextmanager
async def _serving(
    src: ArtifactStore, settings: mt.MooncakeSettings | None = None
) -> AsyncIterator[tuple[mt.TransportServer, int]]:
    """A Mooncake `TransportServer` of `src` (with `settings`, else the engine's) on a free
    loopback port: (the server, its port); closed on exit."""
    server = mt.TransportServer(src, settings=settings)
    port = await server.start()
    try:
        yield server, port
    finally:
        await server.close()


async def _watched(port: int, keys: list[str]) -> mt._Catalog:
    """The catalog of the source at `port` once it lists `keys` (watching starts now)."""
    cat = mt._catalog("127.0.0.1", port)
    assert await _soon(lambda: all(k in cat.entries for k in keys))
    return cat


def _no_control_path() -> None:
    """Close every pooled control connection: a fetch that needs one opens a new one."""
    for pools in list(mt._IDLE.values()):
        for conns in pools.values():
            for _, writer in conns:
                with contextlib.suppress(RuntimeError):  # one of an earlier test's closed loop
                    writer.close()
        pools.clear()


async def test_catalog_listed_artifacts_are_read_one_sided_without_a_control_round_trip() -> None:
    src, dst = _arena_store(), _arena_store()
    payloads = {"tiny": os.urandom(4096), "mid": os.urandom(300 << 10), "big": os.urandom(3 << 20)}
    for i in range(10):  # stored one after another at both ends: one merged engine read
        payloads[f"run{i}"] = os.urandom(1000 + i)
    for k, v in payloads.items():
        src.put(k, v)
    async with _serving(src) as (server, port):
        first = await mt.fetch(dst, "127.0.0.1", port, ["tiny"])  # control path; watching starts
        assert first.fetched == ("tiny",) and first.direct == 0
        dst.delete("tiny")
        await _watched(port, list(payloads))
        assert server._server is not None
        server._server.close()  # no new control connection can be made from here on
        _no_control_path()
        for keys in (["tiny"], [f"run{i}" for i in range(10)], list(payloads)):
            res = await mt.fetch(dst, "127.0.0.1", port, keys)
            assert res.fetched == tuple(keys) and res.missing == () and res.direct == len(keys)
            assert res.bytes == sum(len(payloads[k]) for k in keys)
            for k in keys:
                assert dst.get(k) == payloads[k] and dst.location(k) is not None
                dst.delete(k)
        with pytest.raises(TransferError, match="cannot reach"):  # unlisted: control path
            await mt.fetch(dst, "127.0.0.1", port, ["absent"], timeout_s=2)
    assert dst.arena is not None and dst.arena.used_bytes == 0 and dst.stats().corrupted == 0


async def test_the_catalog_follows_puts_and_deletes_and_hears_heartbeats() -> None:
    src = _arena_store()
    src.put("a", b"a" * 100)
    async with _serving(src) as (_, port):
        await mt.fetch(_arena_store(), "127.0.0.1", port, ["a"])
        cat = await _watched(port, ["a"])
        src.put("b", b"b" * 200)
        assert await _soon(lambda: "b" in cat.entries)
        assert cat.entries["b"][2:] == (200, checksum(b"b" * 200))
        src.delete("a")
        assert await _soon(lambda: "a" not in cat.entries)
        heard = cat.heard_s
        assert await _soon(lambda: cat.heard_s > heard)  # a heartbeat, every 0.5 s
        assert cat.fresh()
    assert await _soon(lambda: not cat.entries)  # the source went away: the catalog is dropped


@pytest.mark.parametrize("control_path", [True, False])
@pytest.mark.parametrize("size", [5000, 600 << 10])  # one engine read; polled pieces
async def test_a_stale_catalog_entry_fails_its_checksum_and_is_never_kept(
    size: int, control_path: bool
) -> None:
    """The source replaced what a catalog entry points at (its push not yet seen): the direct
    read brings other bytes, which are never kept (the one-call fetch commits a new key while
    the engine reads and must take it back here). The control path then brings the right ones;
    without it the fetch fails and the destination holds nothing of the key. Either way its
    arena holds only what it stores."""
    src, dst = _arena_store(), _arena_store()
    k = os.urandom(size)
    src.put("k", k)
    src.put("other", os.urandom(size))
    async with _serving(src) as (server, port):
        await mt.fetch(dst, "127.0.0.1", port, ["other"])
        cat = await _watched(port, ["k", "other"])
        session, _, size, digest = cat.entries["k"]
        cat.entries["k"] = (session, cat.entries["other"][1], size, digest)  # stale address
        if control_path:
            res = await mt.fetch(dst, "127.0.0.1", port, ["k"])
            assert res.fetched == ("k",) and res.direct == 0  # the control path brought it
            assert dst.get("k") == k and dst.keys() == ["other", "k"]
        else:
            assert server._server is not None
            server._server.close()
            _no_control_path()
            with pytest.raises(TransferError):
                await mt.fetch(dst, "127.0.0.1", port, ["k"], timeout_s=2)
            assert not dst.has("k") and dst.keys() == ["other"]
    assert dst.stats().corrupted == 0 and dst.arena is not None
    assert dst.arena.used_bytes == sum(dst.arena.slot_size(x.offset) for x in dst.locations())


async def test_arena_artifacts_are_served_in_place_on_the_control_path() -> None:
    """Large arena artifacts need no copy and no registration at the source; small ones are
    staged from the arena; both arrive intact (also into a store without an arena)."""
    src = _arena_store(128 << 20)
    payloads = {"huge": os.urandom(9 << 20), "small": os.urandom(3000)}
    for k, v in payloads.items():
        src.put(k, v)
    async with _serving(src) as (server, port):
        for dst in (_store(), _arena_store()):
            res = await mt.fetch(dst, "127.0.0.1", port, list(payloads))
            assert set(res.fetched) == set(payloads)
            for k, v in payloads.items():
                assert dst.get(k) == v
        assert server._engine is not None and not server._engine._idle_pins


async def test_fetch_between_two_stores() -> None:
    src, dst = _store(), _store()
    payloads = {f"m@head:{i}": os.urandom(1000 * (i + 1)) for i in range(3)}
    payloads["big"] = os.urandom(3 << 20)  # staged, read straight into its final buffer
    payloads["huge"] = os.urandom(9 << 20)  # sent in place, in batches
    payloads["empty"] = b""
    for i in range(200):  # 600 KB of small artifacts in one batch: hashed by several threads
        payloads[f"s{i}"] = os.urandom(3000)
    await assert_fetches_every_payload(select_transport("mooncake"), src, dst, payloads)


async def test_prefaulting_helper_threads_leave_received_bytes_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hosts of 4+ CPUs fault large receive buffers in on helper threads while the engine writes
    into them; forced on here (CI has 2 CPUs), every byte must still arrive as sent."""
    monkeypatch.setattr(mt, "_prefault_threads", lambda: 2)
    monkeypatch.setattr(mt, "_PREFAULT_POOL", [])
    src, dst = _store(), _store()
    payloads = {f"big{i}": os.urandom((9 << 20) + i * 4097) for i in range(3)}
    for k, v in payloads.items():
        src.put(k, v)
    async with _serving(src) as (_, port):
        res = await mt.fetch(dst, "127.0.0.1", port, list(payloads))
    (pool,) = mt._PREFAULT_POOL  # the helper threads did run
    pool.shutdown(wait=True)
    assert set(res.fetched) == set(payloads)
    for k, v in payloads.items():
        assert dst.get(k) == v


async def test_many_keys_and_chunked_artifacts_through_a_small_staging_buffer() -> None:
    """Four regions of 64 KiB: 600 small artifacts are packed many per region, artifacts of up
    to 1 MiB are chunked over several batches (staged, or from 512 KiB on sent in place), and
    three concurrent fetches share the regions."""
    src = _store()
    small = {f"s{i}": os.urandom(1 + (i * 37) % 3000) for i in range(600)}
    large = {f"l{i}": os.urandom((64 << 10) * (i + 1) + i) for i in range(1, 16, 4)}
    for k, v in (small | large).items():
        src.put(k, v)
    engine = mt._engine(None, "127.0.0.1")
    pinned_before = set(engine._pins)  # earlier tests' pins may still be in their grace period
    keys = list(small) + list(large)
    dsts = [_store() for _ in range(3)]
    async with _serving(src, SMALL_STAGING) as (_, port):
        results = await asyncio.gather(
            *(mt.fetch(d, "127.0.0.1", port, [*keys[j::2], "nope"]) for j, d in enumerate(dsts))
        )
        again = await mt.fetch(dsts[0], "127.0.0.1", port, keys[:5])  # server still serves
        deadline = time.monotonic() + 5  # the server handles the last acknowledgements
        while set(engine._pins) - pinned_before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert set(engine._pins) <= pinned_before  # in-place registrations all released
    for j, (d, res) in enumerate(zip(dsts, results, strict=True)):
        assert list(res.fetched) == keys[j::2] and res.missing == ("nope",)
        for k in keys[j::2]:
            assert d.get(k) == (small | large)[k]
    assert list(again.fetched) == keys[:5]


async def test_control_connections_are_reused_and_a_restarted_peer_is_reconnected() -> None:
    src = _store()
    src.put("k", b"v" * 5000)
    server = mt.TransportServer(src)
    port = await server.start()
    try:
        for _ in range(3):
            assert (await mt.fetch(_store(), "127.0.0.1", port, ["k"])).fetched == ("k",)
        assert len(server._handlers) == 1  # one control connection served all three
    finally:
        await server.close()  # the idle pooled connection is now dead
    server = mt.TransportServer(src)
    assert await server.start(port=port) == port
    try:
        res = await mt.fetch(_store(), "127.0.0.1", port, ["k"])
    finally:
        await server.close()
    assert res.fetched == ("k",)


async def test_an_artifact_served_in_place_stays_registered_within_the_pin_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = _store()
    big = os.urandom(5 << 20)  # at least in_place_bytes (4 MiB): registered where it lies
    src.put("big", big)
    async with _serving(src) as (_, port):
        engine = mt._engine(None, "127.0.0.1")
        at = mt._address_of(src.read_for_transfer("big")[0])
        calls: list[tuple[str, int]] = []
        register, unregister = engine.register, engine.unregister

        def counted_register(addr: int, size: int) -> None:
            calls.append(("register", addr))
            register(addr, size)

        def counted_unregister(addr: int) -> None:
            calls.append(("unregister", addr))
            unregister(addr)

        monkeypatch.setattr(engine, "register", counted_register)
        monkeypatch.setattr(engine, "unregister", counted_unregister)
        for _ in range(3):
            dst = _store()
            assert (await mt.fetch(dst, "127.0.0.1", port, ["big"])).fetched == ("big",)
            assert dst.get("big") == big
        # registered once for three fetches, and still registered (idle) after them (the
        # owner lets go once it has read the last acknowledgement)
        assert calls.count(("register", at)) == 1 and ("unregister", at) not in calls
        assert await _soon(lambda: at in engine._idle_pins)
        # a cache of 0 bytes unregisters as soon as no request holds it
        monkeypatch.setattr(engine, "settings", replace(engine.settings, pin_cache_bytes=0))
        dst = _store()
        assert (await mt.fetch(dst, "127.0.0.1", port, ["big"])).fetched == ("big",)
        assert await _soon(lambda: calls.count(("unregister", at)) == 1)
        assert at not in engine._idle_pins and engine._idle_bytes == 0


async def test_concurrent_fetches_through_the_smallest_staging_buffer_all_complete() -> None:
    """Two regions (the minimum) for six concurrent fetches of staged and in-place artifacts:
    requests wait for regions without ever holding one while waiting (no deadlock)."""
    src = _store()
    payloads = {f"s{i}": os.urandom(5000 + i) for i in range(40)}
    payloads |= {f"b{i}": os.urandom((600 << 10) + i) for i in range(4)}
    for k, v in payloads.items():
        src.put(k, v)
    tiny = mt.MooncakeSettings(
        staging_bytes=2 * (32 << 10), region_bytes=32 << 10, in_place_bytes=512 << 10
    )
    async with _serving(src, tiny) as (_, port):
        keys = list(payloads)
        dsts = [_store() for _ in range(6)]
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(mt.fetch(d, "127.0.0.1", port, keys[j:] + keys[:j]) for j, d in enumerate(dsts))
            )
    for d, res in zip(dsts, results, strict=True):
        assert sorted(res.fetched) == sorted(keys)
        assert all(d.get(k) == v for k, v in payloads.items())


async def test_only_missing_keys() -> None:
    async with _serving(_store()) as (_, port):
        res = await mt.fetch(_store(), "127.0.0.1", port, ["a", "b"])
        empty = await mt.fetch(_store(), "127.0.0.1", port, [])
    assert res.fetched == () and res.missing == ("a", "b") and res.bytes == 0
    assert empty == mt.FetchResult((), (), 0)


async def test_unreachable_peer_is_a_typed_error() -> None:
    server = mt.TransportServer(_store())
    port = await server.start()
    await server.close()  # nothing listens there now
    with pytest.raises(TransferError, match="cannot reach"):
        await mt.fetch(_store(), "127.0.0.1", port, ["k"])


async def test_a_plain_tcp_peer_is_refused_not_misread() -> None:
    src = _store()
    src.put("k", b"v" * 100)
    server = TcpTransportServer(src)
    port = await server.start()
    dst = _store()
    try:
        with pytest.raises(TransferError, match="bad batch frame"):
            await mt.fetch(dst, "127.0.0.1", port, ["k"], timeout_s=5)
    finally:
        await server.close()
    assert not dst.has("k")


@pytest.mark.parametrize(
    "size",
    [5000, 600 << 10, 9 << 20],  # staged; read straight into its buffer; in place, 3 batches
)
async def test_artifact_corrupted_at_the_owner_is_dropped_there_and_answered_missing(
    size: int,
) -> None:
    src = _store()
    src.put("ok", b"o" * 100)
    src.put("k", b"x" * size)
    flipped = bytearray(b"x" * size)
    flipped[size // 2] ^= 1  # bit flip in the owner's memory (not reachable via the API)
    src._mem["k"] = bytes(flipped)
    settings = mt.MooncakeSettings(region_bytes=4 << 20, staging_bytes=16 << 20)
    async with _serving(src, settings) as (_, port):
        dst = _store()
        res = await mt.fetch(dst, "127.0.0.1", port, ["ok", "k"])
    assert (res.fetched, res.missing) == (("ok",), ("k",))
    assert not dst.has("k") and dst.get("ok") == b"o" * 100
    assert not src.has("k") and src.stats().corrupted == 1


async def test_payload_failing_its_checksum_in_transit_is_not_stored() -> None:
    """A source whose staged bytes do not match the checksum it announces (a bit flip between
    staging and the wire; not producible with a real sidecar, so a hand-written source serves
    them, through the real engine)."""
    engine = mt._engine(None, "127.0.0.1")
    staged = mt._Buffer(engine, 1 << 20)
    staged.view[: 1 << 19] = b"e" * (1 << 19)  # large: read straight into the final buffer
    staged.view[1 << 19 : (1 << 19) + 4] = b"evil"  # small: via the receive buffer

    async def bad_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await mt._read_frame(reader)
        frame = {
            "batch": 0,
            "session": engine.session_id,
            "new": [
                [0, 1 << 19, checksum(b"g" * (1 << 19)).hex()],
                [1, 4, checksum(b"good").hex()],
            ],
            "missing": [],
            "parts": [[0, 0, 1 << 19, staged.addr], [1, 0, 4, staged.addr + (1 << 19)]],
            "last": True,
        }
        writer.write(mt._frame(frame))
        await writer.drain()
        await mt._read_frame(reader)  # the ack
        writer.close()

    server = await asyncio.start_server(bad_peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dst = _store()
    try:
        with pytest.raises(TransferError, match="checksum"):
            await mt.fetch(dst, "127.0.0.1", port, ["big", "k"])
    finally:
        server.close()
        await server.wait_closed()
        staged.retire()
    assert dst.keys() == []


@pytest.mark.parametrize(
    ("new", "missing", "match"),
    [
        ([], [], "ended the transfer early"),  # a key left unanswered
        ([[0, 10, checksum(b"x" * 10).hex()]], [], "ended the transfer early"),  # no bytes
        ([[0, 1 << 40, checksum(b"").hex()]], [], "exceed every tier"),  # absurd size
        ([[5, 1, checksum(b"").hex()]], [], "out of range"),  # not a key asked for
    ],
)
async def test_a_peer_breaking_the_protocol_is_a_typed_error(
    new: list[object], missing: list[int], match: str
) -> None:
    """Frames no real source sends (so a hand-written peer sends them)."""
    engine = mt._engine(None, "127.0.0.1")

    async def bad_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await mt._read_frame(reader)
        frame = {"batch": 0, "session": engine.session_id, "new": new, "missing": missing}
        writer.write(mt._frame(frame | {"parts": [], "last": True}))
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await mt._read_frame(reader)
        writer.close()

    server = await asyncio.start_server(bad_peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dst = _store()
    try:
        with pytest.raises(TransferError, match=match):
            await mt.fetch(dst, "127.0.0.1", port, ["k"], timeout_s=5)
    finally:
        server.close()
        await server.wait_closed()
    assert dst.keys() == []


SERVE = """
import asyncio, os, sys
from workers.sidecar.arena import Arena
from workers.sidecar.store import ArtifactStore
from workers.sidecar.mooncake_transport import MooncakeSettings, TransportServer
async def main():
    arena = Arena(N * SIZE + (1 << 20)) if ARENA else None
    s = ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False, arena=arena)
    base = os.urandom(SIZE)
    for i in range(N):
        s.put(f"k{i}", i.to_bytes(4, "big") + base[4:])
    settings = MooncakeSettings(staging_bytes=64 << 20, region_bytes=4 << 20)
    port = await TransportServer(s, settings=settings).start(HOST)
    print(port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _spawn_source(
    n: int, size: int, host: str = "127.0.0.1", *, arena: bool = False
) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", f"N={n}\nSIZE={size}\nHOST={host!r}\nARENA={arena}\n" + SERVE],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


@pytest.mark.timeout(60)
async def test_owner_killed_mid_transfer() -> None:
    n, size = 48, 8 << 20
    proc, port = await asyncio.to_thread(_spawn_source, n, size)
    dst = _store()
    keys = [f"k{i}" for i in range(n)]
    await fetch_as_the_owner_is_killed(proc, dst, mt.fetch(dst, "127.0.0.1", port, keys), 30)
    for k in assert_only_whole_artifacts(dst, n, size):  # each its own, too
        assert dst.get(k)[:4] == int(k[1:]).to_bytes(4, "big")


@pytest.mark.timeout(60)
async def test_owner_killed_during_a_direct_read() -> None:
    """The owner dies while a fetch reads its arena one-sided: the fetch fails with a typed
    error, nothing is stored, every reserved slot goes back, and the catalog is dropped."""
    n, size = 48, 8 << 20
    proc, port = await asyncio.to_thread(_spawn_source, n, size, arena=True)
    dst = _arena_store((n + 1) * size)
    keys = [f"k{i}" for i in range(n)]
    try:
        assert (await mt.fetch(dst, "127.0.0.1", port, ["k0"])).fetched == ("k0",)
        dst.delete("k0")
        cat = await _watched(port, keys)
        task = asyncio.create_task(mt.fetch(dst, "127.0.0.1", port, keys))
        await asyncio.sleep(0.005)
        proc.kill()
        with pytest.raises(TransferError):
            await task
    finally:
        proc.kill()
        proc.wait()
    assert dst.keys() == [] and not cat.entries
    assert dst.arena is not None
    assert await _soon(lambda: dst.arena is not None and dst.arena.used_bytes == 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "size",
    [4096, mt.INLINE_PIECE + 4096, 3 << 20],
    ids=["one-read", "one-call-pieces", "loop-pieces"],
)
async def test_a_small_direct_read_from_a_dead_owner_fails_cleanly(size: int) -> None:
    """A single artifact read on the loop (the one-call path, as one read or in pieces, and the
    general direct path's polled pieces): the owner is dead before the destination's loop has
    seen its catalog end, so the engine reads themselves fail (or, while the engine retries
    the refused connection, are given up after `LOOP_WAIT_S`). Nothing is stored, the slot goes
    back (once the engine lets go of it), the catalog is dropped, and the control path reports
    the dead peer."""
    proc, port = await asyncio.to_thread(_spawn_source, 2, size, arena=True)
    dst = _arena_store()
    try:
        assert (await mt.fetch(dst, "127.0.0.1", port, ["k0"])).fetched == ("k0",)
        dst.delete("k0")
        cat = await _watched(port, ["k0", "k1"])
        proc.kill()
        proc.wait()  # blocking: the loop has not run since, so the catalog still lists k1
        cat.heard_s = time.monotonic()  # as if a heartbeat had just come (a slow box may lag)
        assert "k1" in cat.entries and cat.fresh()
        with pytest.raises(TransferError):
            await mt.fetch(dst, "127.0.0.1", port, ["k1"], timeout_s=5)
    finally:
        proc.kill()
        proc.wait()
    assert dst.keys() == [] and not cat.entries
    assert await _soon(lambda: dst.arena is not None and dst.arena.used_bytes == 0, 40)


@pytest.mark.timeout(60)
async def test_a_source_bound_to_all_interfaces_advertises_a_reachable_engine() -> None:
    """Bound to 0.0.0.0, the source's engine takes the default route's address (peers cannot
    reach "0.0.0.0"); the fetch reaches the control port on loopback and the engine there."""
    proc, port = await asyncio.to_thread(_spawn_source, 3, 300 << 10, "0.0.0.0")
    dst = _store()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(mt._frame({"keys": []}))
        session = (await mt._read_frame(reader))["session"]
        writer.close()
        res = await mt.fetch(dst, "127.0.0.1", port, ["k0", "k1", "k2"], timeout_s=20)
    finally:
        proc.kill()
        proc.wait()
    assert isinstance(session, str) and not session.startswith(("0.0.0.0:", ":"))
    assert res.fetched == ("k0", "k1", "k2")
    assert dst.get("k2")[:4] == (2).to_bytes(4, "big")


@pytest.mark.timeout(60)
async def test_stopped_owner_times_out() -> None:
    """A source that stops answering (SIGSTOP) is a `TransferError` after `timeout_s`."""
    proc, port = await asyncio.to_thread(_spawn_source, 2, 1 << 20)
    dst = _store()
    try:
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=r"failed|timed out"):
            await mt.fetch(dst, "127.0.0.1", port, ["k0", "k1"], timeout_s=1.0)
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait()
    assert dst.keys() == []


@pytest.mark.timeout(90)
def _all_stopped(pid: int) -> bool:
    """Whether every thread of the process is stopped (SIGSTOP reaches them a while after
    `send_signal` returns; an engine thread still running could answer one more read)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)


@pytest.mark.parametrize(
    "size, keys",
    [(4096, 1), (mt.INLINE_PIECE + 4096, 1), (64 << 10, 3)],
    ids=["one-read", "one-call-pieces", "loop-read"],
)
async def test_a_source_frozen_during_a_read_on_the_loop_stalls_it_briefly(
    size: int, keys: int
) -> None:
    """The source freezes (SIGSTOP) while its catalog is still fresh, so the destination reads
    it one-sided on its event loop and the engine waits for bytes that do not come. The loop
    gives the read up after `LOOP_WAIT_S` (the engine itself would wait 30 s) and the fetch
    goes on, awaiting, to the control path, which times out. The slots stay reserved until the
    engine lets go of them, then go back; nothing is stored."""
    proc, port = await asyncio.to_thread(_spawn_source, keys + 1, size, arena=True)
    dst = _arena_store()
    names = [f"k{i}" for i in range(1, keys + 1)]
    gaps = [0.0]

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps[0] = max(gaps[0], now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        assert (await mt.fetch(dst, "127.0.0.1", port, ["k0"])).fetched == ("k0",)
        cat = await _watched(port, ["k0", *names])
        proc.send_signal(signal.SIGSTOP)
        assert await _soon(lambda: _all_stopped(proc.pid), timeout_s=10)
        cat.heard_s = time.monotonic()  # fresh: the reads run on the loop
        gaps[0] = 0.0
        with pytest.raises(TransferError):
            await mt.fetch(dst, "127.0.0.1", port, names, timeout_s=1.0)
        # held for LOOP_WAIT_S at most (plus a busy machine's pauses); the engine's own wait
        # would have held the loop for 30 s
        assert gaps[0] < 5.0
    finally:
        tick.cancel()
        proc.kill()
        proc.wait()
    assert dst.keys() == ["k0"] and not cat.entries
    k0 = dst.location("k0")
    arena = dst.arena
    assert k0 is not None and arena is not None
    assert await _soon(lambda: arena.used_bytes == arena.slot_size(k0.offset), timeout_s=40)


async def test_bad_requests_get_an_error_frame_and_the_server_keeps_serving() -> None:
    src = _store()
    src.put("k", b"z" * 10)
    async with _serving(src) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(mt._frame({"keys": "not a list"}))
        await writer.drain()
        answer = await mt._read_frame(reader)
        writer.close()
        assert "error" in answer
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xff\xff\xff\xffgarbage")
        await writer.drain()
        assert await reader.read() == b""  # closed on a bad frame
        writer.close()
        res = await mt.fetch(_store(), "127.0.0.1", port, ["k"])
    assert res.fetched == ("k",)


def test_direct_reads_merge_adjacent_artifacts_and_cut_submissions_to_the_piece_size() -> None:
    def inc(addr: int, size: int) -> mt._Incoming:
        return mt._Incoming(f"k{addr}", size, b"", b"", addr)

    items = [inc(1000, 300), inc(1300, 300), inc(5000, 900), inc(9000, 100)]
    remote = [70_000, 70_300, 80_000, 70_600]  # the first two adjacent at both ends
    d = mt._Direct("s", items, remote)
    mt._plan_direct(d, 512)
    assert [g.bytes for g in d.groups] == [512, 512, 512, 64]
    assert d.groups[0].local == [1000] and d.groups[0].remote == [70_000]
    assert [(s[0].addr, s[1], s[2]) for s in d.groups[0].spans] == [(1000, 0, 300), (1300, 0, 212)]
    assert d.groups[1].local == [1512, 5000] and d.groups[1].length == [88, 424]
    got: dict[int, int] = {}
    for g in d.groups:
        assert sum(g.length) == g.bytes == sum(n for *_, n in g.spans)
        for it, pos, n in g.spans:
            assert pos == got.get(it.addr, 0)  # every artifact's spans in order, no gaps
            got[it.addr] = pos + n
    assert got == {it.addr: it.size for it in items}


def test_a_catalog_keeps_the_newest_entries_up_to_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mt, "MAX_CATALOG_ENTRIES", 3)
    loop = asyncio.new_event_loop()
    try:
        cat = mt._Catalog("127.0.0.1", 1, loop)
    finally:
        loop.close()
    d = checksum(b"x").hex()
    cat.apply({"catalog": "s", "put": [[f"k{i}", 100 + i, 10, d] for i in range(4)], "gone": []})
    assert list(cat.entries) == ["k1", "k2", "k3"]
    cat.apply({"catalog": "s", "put": [["k1", 500, 10, d], ["k4", 600, 10, d]], "gone": ["k3"]})
    assert list(cat.entries) == ["k2", "k1", "k4"] and cat.entries["k1"][1] == 500
    bad_frames: list[dict[str, object]] = [
        {"catalog": "s", "put": [["k", 0, 10, d]], "gone": []},
        {"put": [], "gone": []},
        {"catalog": "s", "put": [["k", 1, 10]], "gone": []},
        {"catalog": "s", "put": [["k", "x", 10, d]], "gone": []},
        {"catalog": "s", "put": [["k", 1, 10, "zz"]], "gone": []},
        {"catalog": "s", "put": [7], "gone": []},
    ]
    for bad in bad_frames:
        with pytest.raises(mt.TransferError):
            cat.apply(bad)


async def test_a_read_awaited_past_its_polling_budget_completes_through_the_engines_wait() -> None:
    """`_await_read` polls without pause, then with short sleeps: with the spinning budget
    already spent, every piece of a read still lands whole, and the bytes are the source's."""
    src, dst = _arena_store(), _arena_store()
    payload = os.urandom(4 * mt.INLINE_PIECE + 123)
    src.put("k", payload)
    async with _serving(src) as (_, port):
        await mt.fetch(dst, "127.0.0.1", port, ["k"])  # starts the engine and the watch
        dst.delete("k")
        cat = await _watched(port, ["k"])
        session, remote, size, _ = cat.entries["k"]
        assert mt._ENGINE is not None and dst.arena is not None
        te = mt._ENGINE.te
        slot = dst.reserve(size)
        assert slot is not None
        local = mt._ENGINE.register_arena(dst.arena) + slot
        for spin_until in (0.0, time.perf_counter() + 10.0):  # fallback at once; polling only
            dst.slot_view(slot, size)[:] = bytes(size)
            ids = [
                int(te.batch_transfer_async_read(session, [local + o], [remote + o], [n]))
                for o, n in ((0, size // 2), (size // 2, size - size // 2))
            ]
            assert all(mt._submitted(i) for i in ids)
            waits = [mt._await_read(te, i, spin_until, time.perf_counter() + 10.0) for i in ids]
            assert waits == [0, 0]
            assert bytes(dst.slot_view(slot, size)) == payload
        dst.release(slot)


def test_engine_submission_ids_that_mean_failure_are_recognised() -> None:
    assert not mt._submitted(0)  # the engine could not submit
    assert not mt._submitted((1 << 64) - 1)  # -1 as uint64: the peer's segment did not open
    assert not mt._submitted(-1)
    assert mt._submitted(0x7F00_DEAD_BEEF)
