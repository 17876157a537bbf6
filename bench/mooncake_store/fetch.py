"""A fetch between two processes' Mooncake Store clients against a raw Mooncake Transfer Engine
read of the same bytes, and against the current sidecar fetch path, in one run.

One `mooncake_master` for the run. Per row, a source process puts `keys` objects of `size`
random bytes through its `StoreClient` (into its own segment, as a `--store` sidecar does) and
holds the same bytes, contiguous, in a buffer registered with its own Transfer Engine. The
fetching process (a client with no segment of its own, so every byte crosses processes) then
measures, interleaved per repeat in an order shuffled anew each repeat:

- store fetch: `StoreClient.get_into` of all the row's keys in one batch into a registered
  buffer, each payload verified against its digest there (what `StoreTier.fetch` does);
- replicas cached: the same through a second client with its replica cache on
  (`ClientSettings.replica_cache_s`, 5 s): from a key's second read on, ranged gets through a
  get session's cached replica (no master round trip), each checked against the key's digest;
- store tier: the same through a client set up as the sidecar's store tier sets it up (the
  replica cache, and `direct_reads`: a batch of several keys looked up in one call, its
  replicas read where they lie, neighbours in one transfer);
- raw TE: one `transfer_sync_read` of all the row's bytes (the strongest raw baseline); for rows
  of many keys also `raw per-artifact`: one `batch_transfer_sync_read`, a segment per artifact.

Then, in the same run, the same row through the current sidecar fetch path over Mooncake
(`bench.sidecar.transfer.row`: its own owner process, its `mooncake sidecar` column, interleaved
with its own raw read).

Loopback TCP, medians.

    .venv/bin/python -m bench.mooncake_store.fetch [--repeats N] [--rows SIZExKEYS,...]
        [--no-sidecar]
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
from collections.abc import Callable

from bench.sidecar import transfer as sidecar_bench
from workers.mooncake_store import (
    CHECKSUM_BYTES,
    ClientSettings,
    MasterAddress,
    MooncakeMaster,
    StoreClient,
)
from workers.sidecar import mooncake_transport as mt

KiB, MiB = 1 << 10, 1 << 20
CACHE_S = 5.0
"""The replica cache's lifetime in the `replicas cached` column (the sidecar's and the
connector's default)."""
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


def source(master: MasterAddress, size: int, keys: int) -> None:
    """The source process: the row's objects in its store segment, the same bytes in TE."""
    payload = os.urandom(size * keys)
    stride = size + CHECKSUM_BYTES
    client = StoreClient.open(ClientSettings(master, segment_bytes=stride * keys + (64 << 20)))
    staging = client.buffer(stride * keys)
    for i in range(keys):
        staging.view[i * stride : i * stride + size] = payload[i * size : (i + 1) * size]
    addrs = [staging.address + i * stride for i in range(keys)]
    codes = client.put_from([f"o{i}" for i in range(keys)], addrs, [size] * keys)
    assert codes == [0] * keys, codes
    engine = mt._engine(None, "127.0.0.1")
    raw = mt._Buffer(engine, len(payload))
    raw.view[:] = payload
    print(engine.session_id, raw.addr, flush=True)
    sys.stdin.read()  # until the fetcher is done
    client.close()


def _rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e6


def row(
    master: MasterAddress,
    client: StoreClient,
    cached_client: StoreClient,
    tier_client: StoreClient,
    size: int,
    keys: int,
    repeats: int,
) -> dict:
    total = size * keys
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.mooncake_store.fetch", "--source", f"{size}x{keys}",
         "--master", master.url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        session, raw_addr = proc.stdout.readline().split()
        engine = mt._engine(None, "127.0.0.1")
        stride = size + CHECKSUM_BYTES
        dst = client.buffer(stride * keys)
        local = mt._Buffer(engine, total)
        names = [f"o{i}" for i in range(keys)]
        addrs = [dst.address + i * stride for i in range(keys)]
        caps = [stride] * keys
        offsets = [i * size for i in range(keys)]

        def store() -> None:
            assert client.get_into(names, addrs, caps) == [size] * keys

        # the same client code with its replica cache on (`replica_cache_s`): from a key's
        # second read on, a get session's cached replica, no master round trip
        dst_cached = cached_client.buffer(stride * keys)
        addrs_cached = [dst_cached.address + i * stride for i in range(keys)]

        def cached() -> None:
            assert cached_client.get_into(names, addrs_cached, caps) == [size] * keys

        # what the sidecar's store tier runs: the replica cache for a key read again, and a
        # batch's replicas looked up in one call and read where they lie (`direct_reads`)
        dst_tier = tier_client.buffer(stride * keys)
        addrs_tier = [dst_tier.address + i * stride for i in range(keys)]

        def tier() -> None:
            assert tier_client.get_into(names, addrs_tier, caps) == [size] * keys

        def raw_te() -> None:
            assert engine.te.transfer_sync_read(session, local.addr, int(raw_addr), total) == 0

        def raw_seg() -> None:
            rc = engine.te.batch_transfer_sync_read(
                session,
                [local.addr + o for o in offsets],
                [int(raw_addr) + o for o in offsets],
                [size] * keys,
            )
            assert rc == 0

        paths: dict[str, Callable[[], None]] = {
            "store": store,
            "cached": cached,
            "tier": tier,
            "raw": raw_te,
        }
        if keys > 1:
            paths["seg"] = raw_seg
        reps = max(3, min(repeats, (1 << 30) // total))
        t: dict[str, list[float]] = {}
        order = list(paths)
        for rep in range(reps + 1):  # the first round warms connections and pages
            random.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                paths[name]()
                if rep:
                    t.setdefault(name, []).append(time.perf_counter() - t0)
        dst.close()
        dst_cached.close()
        dst_tier.close()
        local.retire()  # unregistered before its memory goes (a later buffer may reuse it)
        return {k: _rate(total, v) for k, v in t.items()}
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def main(repeats: int, rows: list[tuple[int, int]], with_sidecar: bool) -> None:
    if not mt.AVAILABLE:
        raise SystemExit(f"Mooncake Transfer Engine unavailable: {mt.UNAVAILABLE_REASON}")
    with MooncakeMaster() as master:
        client = StoreClient.open(ClientSettings(master.address, segment_bytes=0))
        cached_client = StoreClient.open(
            ClientSettings(master.address, segment_bytes=0, replica_cache_s=CACHE_S)
        )
        tier_client = StoreClient.open(
            ClientSettings(
                master.address, segment_bytes=0, replica_cache_s=CACHE_S, direct_reads=True
            )
        )
        print(
            "| artifacts | store fetch MB/s | raw TE MB/s | ratio | replicas cached MB/s | ratio "
            "| store tier MB/s | ratio | raw per-artifact MB/s | tier / per-artifact "
            "| sidecar fetch MB/s "
            "| store / sidecar |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        nan = float("nan")
        for size, keys in rows:
            r = row(master.address, client, cached_client, tier_client, size, keys, repeats)
            side = nan
            if with_sidecar:
                s = asyncio.run(sidecar_bench.row(size, keys, repeats, True))
                side = s.get("mc", nan)
            st, raw, seg, ca, ti = r["store"], r["raw"], r.get("seg", nan), r["cached"], r["tier"]
            seg_cols = f"{seg:.1f} | {ti / seg:.2f}" if keys > 1 else "- | -"
            print(
                f"| {sidecar_bench._label(size, keys)} | {st:.1f} | {raw:.1f} | {st / raw:.2f} "
                f"| {ca:.1f} | {ca / raw:.2f} | {ti:.1f} | {ti / raw:.2f} | {seg_cols} "
                f"| {side:.1f} | {st / side:.2f} |",
                flush=True,
            )
        client.close()
        cached_client.close()
        tier_client.close()


def _rows(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        size, _, keys = item.partition("x")
        out.append((int(size), int(keys or 1)))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=200, help="repeats per row, at most 1 GiB")
    p.add_argument("--rows", type=_rows, default=ROWS, help="SIZExKEYS,... (bytes x artifacts)")
    p.add_argument(
        "--no-sidecar", action="store_true", help="leave out the current sidecar fetch path"
    )
    p.add_argument("--source", type=str, default="", help=argparse.SUPPRESS)
    p.add_argument("--master", type=str, default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.source:
        size, keys = map(int, a.source.split("x"))
        source(MasterAddress.parse(a.master), size, keys)
    else:
        main(a.repeats, a.rows, not a.no_sidecar)
