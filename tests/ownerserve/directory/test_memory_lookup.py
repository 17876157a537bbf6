"""The in-memory lookup's shortcuts (it skips the range of an artifact whose blocks are all
still mapped to it and any stretch nobody owns; the replica and cached scans visit only the
blocks where something is held or changes, and the replica scan stops once every holder is
found) answer exactly what a scan of every block answers: random claims over
shared prefixes, deltas, overlapping and expired artifacts, replicas, then lookups of random
chains, checked against a reference that probes every block from the deepest."""

from __future__ import annotations

import random

from ownerserve.directory.base import Artifact, HoldKind, Match
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier

ROOT = chain_root("m")


def reference_owners(d: InMemoryDirectory, chain: tuple[int, ...], now: float) -> dict:
    """Deepest block of every live artifact on the chain, and the deepest one's worker."""
    held: dict[tuple[str, Tier], int] = {}
    owner = None
    seen: set[int] = set()
    for i in range(len(chain) - 1, -1, -1):
        aid = d._owner_of_block.get(chain[i])
        if aid is None or aid in seen:
            continue
        seen.add(aid)
        rec = d._artifacts.get(aid)
        if rec is None or rec.expires_at <= now:
            continue
        key = (rec.worker, rec.tier)
        held[key] = max(held.get(key, 0), i + 1)
        if owner is None:
            owner = (rec.worker, i + 1, rec.epoch)
    replicas: dict[tuple[str, Tier], int] = {}
    for i in range(len(chain) - 1, -1, -1):
        for key, (expires, _ro, _inc) in (d._replicas.get(chain[i]) or {}).items():
            if expires > now and key not in replicas:
                replicas[key] = i + 1
    return {"held": held, "owner": owner, "replicas": replicas}


def observed(match: Match) -> dict:
    held = {(h.worker, h.tier): h.blocks for h in match.holdings if h.kind is HoldKind.OWNER}
    owner = (match.owner, match.owner_blocks, match.owner_epoch) if match.owner else None
    replicas = {(h.worker, h.tier): h.blocks for h in match.holdings if h.kind is HoldKind.REPLICA}
    return {"held": held, "owner": owner, "replicas": replicas}


async def test_lookup_matches_a_full_scan_over_random_claims():
    rnd = random.Random(7)
    clock = [1000.0]
    d = InMemoryDirectory(clock=lambda: clock[0])
    # a few conversations sharing leading blocks, each growing turn by turn
    bases = [[rnd.randrange(50) for _ in range(rnd.choice((8, 16, 24)))] for _ in range(4)]
    chains: list[tuple[int, ...]] = []
    for _ in range(60):
        tokens = list(rnd.choice(bases)) + [rnd.randrange(50) for _ in range(rnd.randrange(40))]
        chains.append(tuple(block_hash_chain(tokens, 4, ROOT)))
    for step in range(400):
        chain = rnd.choice(chains)
        if not chain:
            continue
        worker = f"w{rnd.randrange(3)}"
        op = rnd.random()
        if op < 0.55:
            start = rnd.randrange(len(chain))  # deltas and whole chains, overlapping others
            await d.claim(
                Artifact(chain=chain, start=start), worker, rnd.choice((5.0, 50.0, 500.0))
            )
        elif op < 0.7:
            k = rnd.randrange(1, len(chain) + 1)
            ttl = rnd.choice((5.0, 30.0, 300.0))
            await d.add_replica(chain[k - 1], worker, rnd.choice(list(Tier)), ttl, True, chain[:k])
        elif op < 0.8:
            await d.drop_worker(worker)
        elif op < 0.9:
            clock[0] += rnd.choice((1.0, 10.0, 100.0))  # leases expire
        else:
            await d.sweep()
        for probe in rnd.sample(chains, 5):
            if not probe:
                continue
            cut = probe[: rnd.randrange(1, len(probe) + 1)]
            assert observed(await d.lookup(cut)) == reference_owners(d, cut, clock[0]), step
