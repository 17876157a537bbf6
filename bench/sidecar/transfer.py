"""Sidecar-path transfer throughput against raw transfers of the same bytes, in one run.

One owner process per row holds `keys` artifacts of `size` random bytes in `ArtifactStore`s
behind both sidecar transports (over Mooncake, the store keeps them in its engine-registered
arena, as a Mooncake sidecar does), plus the same bytes, contiguous, in a Mooncake-registered
buffer and behind a plain TCP socket. The fetching process measures, interleaved per repeat in
an order shuffled anew each repeat (so every path sees the same machine noise, and each path
follows each other one about equally often: what a path leaves behind, such as the owner still
closing a TCP connection, falls on all of them alike):

- mooncake sidecar: `workers.sidecar.mooncake_transport.fetch` of all the row's keys in one
  fetch into a long-lived store with an arena, as a sidecar has, the keys deleted again after
  each fetch (untimed). After the first (uncounted) round the owner's catalog has arrived: the
  fetch reads the artifacts one-sided into arena slots, verifies their checksums and stores
  them; no control round trip;
- mooncake control path: the same fetch into a fresh store without an arena, which always
  takes the control path (a request frame, staging at the owner, engine reads into fresh
  memory, checksum verification, store put);
- tcp sidecar: `workers.sidecar.transport.fetch` of the same keys (framing, checksum, put);
- raw mooncake: one `TransferEngine.transfer_sync_read` of all the row's bytes into a registered
  buffer, nothing around it (the strongest raw baseline: one contiguous read); for rows of many
  keys also `raw per-artifact`: one `batch_transfer_sync_read` with a segment per artifact;
- raw tcp: the same bytes over a plain TCP connection, no framing, no checksum;
- checksum: hashing the row's bytes once in this process with the store's checksum
  (`workers.sidecar.store.checksum`, XXH3-128; a ceiling for any path that verifies every
  artifact on one core); `vs bound` is the Mooncake sidecar against min(raw mooncake, checksum),
  what perfect overlap of reading and hashing would reach; `one-sided` is the share of the
  Mooncake sidecar's counted artifacts that came over the direct path (the rest took the
  control path: a stale catalog, no free slot).

Loopback, medians. Rows with many keys show batching: on the direct path, artifacts stored one
after another at both ends are moved by one engine read; on the control path, small artifacts
are packed into one staging region and moved by one engine read.

    .venv/bin/python -m bench.sidecar.transfer [--repeats N] [--rows SIZExKEYS,...]
        [--mooncake-only]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from workers.sidecar import mooncake_transport as mt
from workers.sidecar.arena import Arena
from workers.sidecar.store import ArtifactStore, checksum
from workers.sidecar.transport import TransportServer, fetch

KiB, MiB = 1 << 10, 1 << 20
ROWS = [
    (4 * KiB, 1),
    (64 * KiB, 1),
    (1 * MiB, 1),
    (16 * MiB, 1),
    (64 * MiB, 1),
    (4 * KiB, 256),
    (64 * KiB, 64),
    (1 * MiB, 16),
]


async def peer(size: int, keys: int) -> None:
    """The owner process: `keys` artifacts of `size` random bytes behind every server."""
    payload = os.urandom(size * keys)
    store = ArtifactStore(memory_capacity_bytes=2 << 30, pin_memory=False)
    arena = Arena(len(payload) + keys * 64 + (1 << 20))
    in_arena = ArtifactStore(memory_capacity_bytes=2 << 30, pin_memory=False, arena=arena)
    for i in range(keys):
        store.put(f"a{i}", payload[i * size : (i + 1) * size])
        in_arena.put(f"a{i}", payload[i * size : (i + 1) * size])

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readexactly(1):
                writer.write(payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    side_port = await TransportServer(store).start()
    raw_server = await asyncio.start_server(raw, "127.0.0.1", 0)
    raw_port = raw_server.sockets[0].getsockname()[1]
    mc_port, session, raw_addr = 0, "-", 0
    if mt.AVAILABLE:
        mc_port = await mt.TransportServer(in_arena).start()
        engine = mt._engine(None, "127.0.0.1")
        raw_buf = mt._Buffer(engine, len(payload))
        raw_buf.view[:] = payload
        session, raw_addr = engine.session_id, raw_buf.addr
    print(side_port, raw_port, mc_port, session, raw_addr, flush=True)
    await asyncio.Event().wait()


async def raw_fetch(port: int, size: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    await writer.drain()
    await reader.readexactly(size)
    writer.close()


def _rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e6


async def row(size: int, keys: int, repeats: int, mooncake_only: bool) -> dict[str, float]:
    total = size * keys
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.sidecar.transfer", "--peer", f"{size}x{keys}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    names = [f"a{i}" for i in range(keys)]
    t: dict[str, list[float]] = {}
    direct = [0, 0]  # artifacts the Mooncake sidecar fetched one-sided, and fetched in all
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        side, raw_port, mc_port, session, raw_addr = line.split()
        engine = mt._engine(None, "127.0.0.1") if mt.AVAILABLE else None
        local = mt._Buffer(engine, total) if engine is not None else None
        blob = os.urandom(total)
        offsets = [i * size for i in range(keys)]

        async def tcp_sidecar() -> None:
            dst = ArtifactStore(memory_capacity_bytes=2 << 30, pin_memory=False)
            assert (await fetch(dst, "127.0.0.1", int(side), names)).bytes == total

        async def raw_tcp() -> None:
            await raw_fetch(int(raw_port), total)

        async def sha() -> None:
            checksum(blob)

        sidecar_store = ArtifactStore(
            memory_capacity_bytes=2 << 30,
            pin_memory=False,
            arena=Arena(total + keys * 64 + (1 << 20)),
        )

        async def mc_sidecar() -> None:
            res = await mt.fetch(sidecar_store, "127.0.0.1", int(mc_port), names)
            assert res.bytes == total
            direct[0] += res.direct
            direct[1] += len(res.fetched)

        def mc_sidecar_forget() -> None:  # not timed: the next round must fetch them again
            for name in names:
                sidecar_store.delete(name)

        async def mc_control() -> None:
            dst = ArtifactStore(memory_capacity_bytes=2 << 30, pin_memory=False)
            assert (await mt.fetch(dst, "127.0.0.1", int(mc_port), names)).bytes == total

        async def raw_mc() -> None:
            assert engine is not None and local is not None
            rc = engine.te.transfer_sync_read(session, local.addr, int(raw_addr), total)
            assert rc == 0

        async def raw_seg() -> None:
            assert engine is not None and local is not None
            rc = engine.te.batch_transfer_sync_read(
                session,
                [local.addr + o for o in offsets],
                [int(raw_addr) + o for o in offsets],
                [size] * keys,
            )
            assert rc == 0

        paths: dict[str, Callable[[], Awaitable[None]]] = {
            "tcp": tcp_sidecar,
            "raw_tcp": raw_tcp,
            "sha": sha,
        }
        if engine is not None:
            paths |= {"mc": mc_sidecar, "mc_ctl": mc_control, "raw_mc": raw_mc}
            if keys > 1:
                paths["raw_seg"] = raw_seg
        if mooncake_only:
            for name in ("tcp", "raw_tcp", "sha"):
                del paths[name]
        order = list(paths)
        shuffle = random.Random(size * 7919 + keys).shuffle
        reps = max(5, min(repeats, (1 << 30) // total))
        for rep in range(reps + 1):  # the first round warms connections and pages, not counted
            if rep == 1:
                direct[:] = [0, 0]
            shuffle(order)  # so each path follows each other one about equally often
            for name in order:
                t0 = time.perf_counter()
                await paths[name]()
                if rep:
                    t.setdefault(name, []).append(time.perf_counter() - t0)
                if name == "mc":
                    mc_sidecar_forget()
        if local is not None:
            local.retire()
    finally:
        proc.kill()
        proc.wait()
    rates = {k: _rate(total, v) for k, v in t.items()}
    if direct[1]:
        rates["direct_share"] = direct[0] / direct[1]
    return rates


def _label(size: int, keys: int) -> str:
    s = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
    return s if keys == 1 else f"{keys} x {s}"


async def main(repeats: int, rows: list[tuple[int, int]], mooncake_only: bool = False) -> None:
    if not mt.AVAILABLE:
        print(f"# Mooncake unavailable ({mt.UNAVAILABLE_REASON}): TCP columns only")
    print(
        "| artifacts | mooncake sidecar MB/s | raw mooncake MB/s | ratio "
        "| raw per-artifact MB/s | ratio | control path MB/s | ratio "
        "| tcp sidecar MB/s | raw tcp MB/s | ratio | checksum MB/s | vs bound | one-sided |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    nan = float("nan")
    for size, keys in rows:
        r = await row(size, keys, repeats, mooncake_only)
        mc, raw_mc, seg = r.get("mc", nan), r.get("raw_mc", nan), r.get("raw_seg", nan)
        ctl, tcp, raw_tcp, sha = (r.get(k, nan) for k in ("mc_ctl", "tcp", "raw_tcp", "sha"))
        seg_cols = f"{seg:.1f} | {mc / seg:.2f}" if keys > 1 else "- | -"
        print(
            f"| {_label(size, keys)} | {mc:.1f} | {raw_mc:.1f} | {mc / raw_mc:.2f} "
            f"| {seg_cols} | {ctl:.1f} | {ctl / raw_mc:.2f} "
            f"| {tcp:.1f} | {raw_tcp:.1f} | {tcp / raw_tcp:.2f} "
            f"| {sha:.1f} | {mc / min(raw_mc, sha):.2f} | {r.get('direct_share', nan):.2f} |",
            flush=True,
        )


def _rows(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        size, _, keys = item.partition("x")
        out.append((int(size), int(keys or 1)))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--repeats",
        type=int,
        default=400,
        help="repeats per row, at most 1 GiB per path and row (small rows need hundreds for a "
        "steady median)",
    )
    p.add_argument("--rows", type=_rows, default=ROWS, help="SIZExKEYS,... (bytes x artifacts)")
    p.add_argument(
        "--mooncake-only",
        action="store_true",
        help="measure only the Mooncake paths (no TCP and checksum paths between them)",
    )
    p.add_argument("--peer", type=str, default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer:
        size, keys = map(int, a.peer.split("x"))
        asyncio.run(peer(size, keys))
    else:
        asyncio.run(main(a.repeats, a.rows, a.mooncake_only))
