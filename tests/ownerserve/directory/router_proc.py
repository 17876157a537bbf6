"""A minimal router process for the multi-process directory tests: it claims KV artifacts in
a shared Redis directory the way a router replica does, and reports what it saw as JSON lines.

    python -m tests.ownerserve.directory.router_proc race URL NS WORKER N
    python -m tests.ownerserve.directory.router_proc hold URL NS WORKER LEASE_S
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from ownerserve.directory.base import Artifact
from ownerserve.directory.redis import RedisDirectory
from ownerserve.errors import StaleEpochError
from ownerserve.hashing import block_hash_chain, chain_root

ROOT = chain_root("race-model")


def chain_for(i: int, blocks: int = 16) -> tuple[int, ...]:
    return tuple(block_hash_chain([i] * (blocks * 4), 4, ROOT))


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def race(d: RedisDirectory, worker: str, n: int) -> None:
    await d.ping()
    await d.lookup(chain_for(0))  # scripts loaded, connection warm
    say({"ready": True})
    start_key = d.key("race-start")
    while not await d.client.exists(start_key):
        await asyncio.sleep(0.001)
    leases = []
    for i in range(n):
        lease = await d.claim(Artifact(chain_for(i)[:8]), worker, 60.0)
        leases.append([lease.artifact_id, lease.worker, lease.epoch])
    say({"leases": leases})


async def hold(d: RedisDirectory, worker: str, lease_s: float) -> None:
    chain = chain_for(1)
    lease = await d.claim(Artifact(chain[:8]), worker, lease_s)
    say({"claimed": [lease.artifact_id, lease.worker, lease.epoch]})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        await asyncio.sleep(lease_s / 4)
        try:
            await d.renew(lease.artifact_id, worker, lease.epoch, lease_s)
        except StaleEpochError as exc:
            say({"renew": "refused", "why": str(exc)})
            try:
                await d.claim(Artifact(chain[:12], start=8), worker, lease_s, lease.epoch)
                say({"commit": "accepted"})
            except StaleEpochError:
                say({"commit": "refused"})
            return
    say({"renew": "never refused"})


async def main(argv: list[str]) -> int:
    mode, url, ns, worker, arg = argv
    d = RedisDirectory.from_url(url, namespace=ns, socket_timeout_s=10.0)
    try:
        if mode == "race":
            await race(d, worker, int(arg))
        else:
            await hold(d, worker, float(arg))
    finally:
        await d.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
