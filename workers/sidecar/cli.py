"""Command line of `ownerserve worker sidecar` (flags -> `SidecarConfig`, then serve)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ownerserve.config import WORKER_ID_PATTERN

GiB = 1 << 30


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0: {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value


def _directory(text: str) -> str:
    if text == "memory" or text.startswith(("redis://", "rediss://", "unix://")):
        return text
    raise argparse.ArgumentTypeError(f"expected 'memory' or a redis:// URL, got {text!r}")


def _store(text: str) -> str:
    from workers.mooncake_store.master import MasterAddress

    try:
        MasterAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _worker_id(text: str) -> str:
    if re.fullmatch(WORKER_ID_PATTERN, text):
        return text
    raise argparse.ArgumentTypeError(
        f"expected a letter or digit, then letters, digits and ._:@+- (at most 128), got {text!r}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-id",
        type=_worker_id,
        required=True,
        help="id of the worker this sidecar serves, as the router's config names it",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (HTTP and transfer)")
    parser.add_argument("--port", type=_port, default=8200, help="HTTP port (default 8200)")
    parser.add_argument(
        "--store-dir",
        type=Path,
        required=True,
        help="directory of the SSD tier (files in <dir>/ssd, recovered at start)",
    )
    parser.add_argument(
        "--clear-ssd",
        action="store_true",
        help="delete the SSD tier's files of an earlier run at start instead of recovering them",
    )
    parser.add_argument(
        "--memory-bytes",
        type=_size,
        default=2 * GiB,
        help="memory tier capacity, e.g. 2G (default); 0 keeps every artifact in files; over "
        "Mooncake the tier is one arena of this size, registered with the engine at start",
    )
    parser.add_argument(
        "--ssd-bytes", type=_size, default=16 * GiB, help="SSD tier capacity (default 16G)"
    )
    parser.add_argument(
        "--directory",
        type=_directory,
        default="memory",
        help="ownership directory for replicas: 'memory' (this process only) or redis://HOST:PORT",
    )
    parser.add_argument(
        "--directory-prefix", default="os", help="key prefix in Redis (the router's; default os)"
    )
    parser.add_argument(
        "--replica-ttl-s",
        type=float,
        default=30.0,
        help="lease of this sidecar's published replicas (one per tier, whatever it holds); "
        "renewed every third of it (default 30)",
    )
    parser.add_argument(
        "--transfer-port",
        type=_port,
        default=0,
        help="port of the transfer server peers pull from (default: any free port)",
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "mooncake", "tcp"),
        default="auto",
        help="artifact transport: mooncake if available (auto, default), mooncake, or tcp",
    )
    parser.add_argument(
        "--advertise-url",
        default=None,
        help="URL peers reach this sidecar at (default http://HOST:PORT); its host is also "
        "the transfer host peers are told",
    )
    parser.add_argument(
        "--store",
        type=_store,
        default=None,
        help="keep artifacts in Mooncake Store: mooncake://HOST:PORT[?metadata_port=P], the "
        "master's RPC port (and its HTTP metadata server's, default 8080); default: this "
        "process's memory and SSD tiers",
    )
    parser.add_argument(
        "--store-segment-bytes",
        type=_size,
        default=GiB,
        help="memory this sidecar mounts into Mooncake Store, e.g. 1G (default)",
    )
    parser.add_argument(
        "--probe-store-out",
        type=Path,
        default=None,
        help="with --store: at start, time store reads of 1, 4 and 16 MiB over its TCP "
        "transport and write the measured price here for the router's "
        "planner.kv_measurements (a failed probe writes nothing and says why)",
    )
    parser.add_argument(
        "--fetch-timeout-s",
        type=float,
        default=60.0,
        help="limit of one pull from a peer sidecar (default 60)",
    )


def _probe_store(store: str, out: Path, prog: str) -> None:
    """The start-up probe of the store's TCP transport (`workers.mooncake_store.probe`): its
    measured price written to `out`; a failure is reported and the sidecar starts anyway."""
    from ownerserve.kvprobe import PriceSource, write_measurements
    from ownerserve.types import KVTransport
    from workers.mooncake_store.master import MasterAddress
    from workers.mooncake_store.probe import SIZES
    from workers.mooncake_store.probe import run as probe

    price = probe(MasterAddress.parse(store), KVTransport.STORE_TCP, SIZES, 5, "h100-llama3-8b")
    t = price.timing
    print(
        f"{prog}: store_tcp {t.bps / 1e9:.3f} GB/s, latency {t.latency_s * 1e3:.3f} ms "
        f"({price.source.value}: {price.detail})",
        file=sys.stderr,
    )
    if price.source is PriceSource.MEASURED:
        write_measurements(out, [price])


def run(args: argparse.Namespace) -> int:
    from workers.mooncake_store import StoreError
    from workers.sidecar.server import SidecarConfig, run_forever
    from workers.sidecar.transports import TransportUnavailable, select_transport

    prog = "ownerserve worker sidecar"
    if args.replica_ttl_s <= 0 or args.fetch_timeout_s <= 0:
        print(f"{prog}: error: --replica-ttl-s and --fetch-timeout-s must be > 0", file=sys.stderr)
        return 2
    if args.advertise_url is not None and not args.advertise_url.startswith(
        ("http://", "https://")
    ):
        print(f"{prog}: error: --advertise-url must be an http(s) URL", file=sys.stderr)
        return 2
    try:
        transport = select_transport(args.transport)
    except TransportUnavailable as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    config = SidecarConfig(
        worker_id=args.worker_id,
        store_dir=args.store_dir,
        host=args.host,
        port=args.port,
        memory_bytes=args.memory_bytes,
        ssd_bytes=args.ssd_bytes,
        directory=args.directory,
        directory_prefix=args.directory_prefix,
        transfer_port=args.transfer_port,
        transport=transport.name,
        advertise_url=args.advertise_url,
        replica_ttl_s=args.replica_ttl_s,
        fetch_timeout_s=args.fetch_timeout_s,
        clear_ssd=args.clear_ssd,
        store=args.store,
        store_segment_bytes=args.store_segment_bytes,
    )
    if args.probe_store_out is not None:
        if args.store is None:
            print(f"{prog}: error: --probe-store-out needs --store", file=sys.stderr)
            return 2
        _probe_store(args.store, args.probe_store_out, prog)
    try:
        config.store_dir.mkdir(parents=True, exist_ok=True)
        return run_forever(config, transport)
    except StoreError as exc:  # the store named by --store cannot be reached
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
