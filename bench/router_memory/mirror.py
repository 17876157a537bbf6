"""What the resilient directory's local mirror of the workers' caches costs, and that its bound
holds: an `InMemoryDirectory` fed the KV events of many sessions on several workers (each
session a shared system prompt plus its own blocks, looked up as the router does), traced by
tracemalloc, unbounded and with `cached_limit`: bytes per (block, worker) pair and the traced
heap as the pairs stored grow, as a markdown table.

    .venv/bin/python -m bench.router_memory.mirror [--workers 6] [--pairs 200000] [--limit 65536]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tracemalloc

from ownerserve.directory import InMemoryDirectory
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root

BS = 16
ROOT = chain_root("mirror-bench")
SYSTEM = 64
OWN = 256


async def feed(
    d: InMemoryDirectory, workers: int, pairs: int, every: int
) -> list[tuple[int, int, int]]:
    """Store sessions round-robin on the workers until `pairs` pairs were stored; every `every`
    pairs stored, (pairs stored, traced heap bytes, pairs kept)."""
    system = list(range(SYSTEM * BS))
    seq = [0] * workers
    stored = 0
    out: list[tuple[int, int, int]] = []
    session = 0
    next_mark = every
    for w in range(workers):
        await d.register_worker(f"w{w}", ROOT, BS)
    while stored < pairs:
        w = session % workers
        toks = system + [(session + 1) * 1_000_000 + i for i in range(OWN * BS)]
        chain = tuple(block_hash_chain(toks, BS, ROOT))
        d.note_chain(f"s{session}", chain)
        base = (w + 1) << 40
        events = []
        if session < workers:
            hashes = tuple(base + b for b in range(SYSTEM))
            events.append(BlockStored(hashes, None, tuple(toks[: SYSTEM * BS]), BS))
        own = tuple(base + (session + 1) * 10_000 + b for b in range(OWN))
        events.append(BlockStored(own, base + SYSTEM - 1, tuple(toks[SYSTEM * BS :]), BS))
        seq[w] += 1
        await d.apply_events(f"w{w}", EventBatch(seq[w], 0.0, tuple(events)))
        stored += OWN + (SYSTEM if session < workers else 0)
        session += 1
        if stored >= next_mark:
            gc.collect()
            out.append((stored, tracemalloc.get_traced_memory()[0], d.cached_pairs))
            next_mark += every
    return out


async def run(workers: int, pairs: int, limit: int) -> None:
    print(f"{workers} workers, {pairs:,} pairs stored, sessions of {SYSTEM} + {OWN} blocks\n")
    print("| view | pairs stored | pairs kept | traced heap MiB | bytes a pair kept |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for cap in (None, limit):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        d = InMemoryDirectory(cached_limit=cap)
        for n, traced, kept in await feed(d, workers, pairs, pairs // 8):
            label = "unbounded" if cap is None else f"cached_limit {cap:,}"
            per = (traced - base) / max(kept, 1)
            print(f"| {label} | {n:,} | {kept:,} | {(traced - base) / 2**20:.1f} | {per:.0f} |")
        del d
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--limit", type=int, default=65_536)
    args = ap.parse_args()
    asyncio.run(run(args.workers, args.pairs, args.limit))


if __name__ == "__main__":
    main()
