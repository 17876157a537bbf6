"""The start-up probe of a store transport: time `get_into` of objects of a few sizes that one
client holds in its segment and another (no segment of its own) reads, fit
`latency_s + bytes / bps` (`ownerserve.kvprobe.fit_transport`), and write the measured price for
the router's `planner.kv_measurements`. A failed probe writes nothing and says why; the router then
plans with the profile's configured price.

    python -m workers.mooncake_store.probe --master mooncake://HOST:PORT?metadata_port=P \
        --transport store_tcp --out kv-measurements.yaml [--sizes 1MiB,4MiB,16MiB] [--repeats 5]
    python -m workers.mooncake_store.probe --own-master ...   (starts its own mooncake_master)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ownerserve.kvprobe import ProbeSample, TransportPrice, measure_price, write_measurements
from ownerserve.profiles import load_profile
from ownerserve.types import KVTransport
from workers.mooncake_store.client import CHECKSUM_BYTES, ClientSettings, StoreClient
from workers.mooncake_store.master import MasterAddress, MooncakeMaster

MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB, 16 * MiB)


class ProbeFailed(RuntimeError):
    """A store operation of the probe did not do what it must (a put refused, a short read)."""


def measure_store(
    holder: StoreClient,
    reader: StoreClient,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[ProbeSample]:
    """Per size: `holder` puts one object of random bytes into its own segment, `reader` reads it
    with `get_into` once to warm the path and then `repeats` times; the sample is the median
    read. The objects are removed afterwards."""
    samples: list[ProbeSample] = []
    top = max(sizes) + CHECKSUM_BYTES
    src = holder.buffer(top)
    dst = reader.buffer(top)
    keys: list[str] = []
    try:
        for size in sizes:
            key = f"ownerserve-probe-{os.getpid()}-{size}"
            src.view[:size] = os.urandom(size)
            codes = holder.put_from([key], [src.address], [size])
            if codes != [0]:
                raise ProbeFailed(f"put of {size} B answered {codes}")
            keys.append(key)
            times = []
            for i in range(repeats + 1):
                t0 = clock()
                got = reader.get_into([key], [dst.address], [size + CHECKSUM_BYTES])
                t1 = clock()
                if got != [size]:
                    raise ProbeFailed(f"get_into of {size} B answered {got}")
                if i:
                    times.append(t1 - t0)
            samples.append(ProbeSample(size, statistics.median(times)))
    finally:
        if keys:
            holder.remove(keys)
        dst.close()
        src.close()
    return samples


def probe(
    master: MasterAddress, protocol: str, sizes: Sequence[int], repeats: int
) -> list[ProbeSample]:
    """Open the two clients against `master` over `protocol` and `measure_store`."""
    segment = 2 * (max(sizes) + CHECKSUM_BYTES) + (16 << 20)
    holder = StoreClient.open(ClientSettings(master, segment_bytes=segment, protocol=protocol))
    try:
        reader = StoreClient.open(ClientSettings(master, segment_bytes=0, protocol=protocol))
        try:
            return measure_store(holder, reader, sizes, repeats)
        finally:
            reader.close()
    finally:
        holder.close()


def run(
    master: MasterAddress | None,
    transport: KVTransport,
    sizes: Sequence[int],
    repeats: int,
    profile: str,
) -> TransportPrice:
    """The transport's price: measured through `master` (None: a `mooncake_master` of its own
    for the run), or the profile's configured one with the reason the probe failed."""
    protocol = "rdma" if transport is KVTransport.STORE_RDMA else "tcp"
    configured = load_profile(profile).link.path(transport)

    def measure() -> list[ProbeSample]:
        if master is not None:
            return probe(master, protocol, sizes, repeats)
        with MooncakeMaster() as own:
            return probe(own.address, protocol, sizes, repeats)

    return measure_price(transport, configured, measure)


def _size(text: str) -> int:
    text = text.strip()
    for suffix, mult in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--master", type=MasterAddress.parse, help="mooncake://HOST:PORT?...")
    where.add_argument("--own-master", action="store_true", help="start a mooncake_master")
    p.add_argument(
        "--transport",
        type=KVTransport,
        choices=[KVTransport.STORE_TCP, KVTransport.STORE_RDMA],
        default=KVTransport.STORE_TCP,
    )
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB", help="object sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed reads per size (median)")
    p.add_argument("--profile", default="h100-llama3-8b", help="the configured price's profile")
    p.add_argument("--out", type=Path, help="write the measured price here (nothing if failed)")
    a = p.parse_args(argv)
    sizes = [_size(s) for s in a.sizes.split(",")]
    price = run(a.master, a.transport, sizes, a.repeats, a.profile)
    t = price.timing
    print(
        f"{price.transport.value}: {t.bps / 1e9:.3f} GB/s, latency {t.latency_s * 1e6:.1f} us "
        f"({price.source.value}: {price.detail})"
    )
    if a.out is not None and price.source.value == "measured":
        write_measurements(a.out, [price])
    return 0 if price.source.value == "measured" else 1


if __name__ == "__main__":
    sys.exit(main())
