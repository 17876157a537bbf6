"""Sidecar-path transfer throughput against a raw transfer of the same bytes, in one run.

Sidecar path: `workers.sidecar.transport.fetch` from a peer `TransportServer` (another process)
into an `ArtifactStore`: framing, the owner's checksum verification on load, the receiver's
checksum verification while receiving, the store put. Raw: the same bytes from the same peer
process over a plain TCP connection, no framing, no checksum. Mooncake Transfer Engine is not
installed here, so the raw baseline is a TCP socket. Both over loopback, interleaved per repeat.

    .venv/bin/python -m bench.sidecar.transfer [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from workers.sidecar.store import ArtifactStore
from workers.sidecar.transport import TransportServer, fetch

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


async def peer(size: int) -> None:
    """The owner process: one artifact of `size` random bytes behind both servers."""
    payload = os.urandom(size)
    store = ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False)
    store.put("a", payload)

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
    print(side_port, raw_server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


async def raw_fetch(port: int, size: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    await writer.drain()
    await reader.readexactly(size)
    writer.close()


async def main(repeats: int) -> None:
    print(f"{'size':>10} {'sidecar MB/s':>13} {'raw tcp MB/s':>13} {'ratio':>6}")
    for size in SIZES:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.sidecar.transfer", "--peer", str(size)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            side_port, raw_port = map(int, proc.stdout.readline().split())
            reps = max(5, min(repeats, (512 << 20) // size))
            t_side: list[float] = []
            t_raw: list[float] = []
            for _ in range(reps):  # interleaved so both see the same machine noise
                dst = ArtifactStore(memory_capacity_bytes=1 << 30, pin_memory=False)
                t0 = time.perf_counter()
                await fetch(dst, "127.0.0.1", side_port, ["a"])
                t_side.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await raw_fetch(raw_port, size)
                t_raw.append(time.perf_counter() - t0)
        finally:
            proc.kill()
            proc.wait()
        s, r = statistics.median(t_side), statistics.median(t_raw)
        print(f"{size:>10} {size / s / 1e6:>13.1f} {size / r / 1e6:>13.1f} {r / s:>6.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--peer", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    asyncio.run(peer(a.peer) if a.peer else main(a.repeats))
