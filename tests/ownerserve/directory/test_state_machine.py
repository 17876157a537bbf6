"""Hypothesis state machine: the in-memory and Redis backends (plain, and inside the healthy
`ResilientDirectory`, whose local mirror is checked too) against a brute-force model: lookups,
and the GPU-cached counts (distinct blocks, copies) after every step.

The model keeps leases as "who holds which blocks" and answers lookups by scanning
everything; the backends keep per-block indexes. Leases here never expire (time-based
expiry is covered by the contract suite), so every answer is deterministic.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from ownerserve.directory import InMemoryDirectory
from ownerserve.directory.base import Artifact, CachedCounts, Holding, HoldKind, Lease, Match
from ownerserve.directory.common import sort_holdings
from ownerserve.directory.redis import RedisDirectory
from ownerserve.directory.resilient import ResilientDirectory
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import TIER_ORDER, Tier
from tests.conftest import RedisServer

BS = 2
ROOT = chain_root("sm-model")
N = 6
_TOKENS = [list(range(100, 100 + N * BS)), list(range(100, 100 + 3 * BS)) + [7] * (3 * BS)]
TOKENS = _TOKENS
CHAINS = [tuple(block_hash_chain(t, BS, ROOT)) for t in TOKENS]  # share their first 3 blocks
WORKERS = ("w1", "w2", "w3")
SESSIONS = ("s1", "s2")
LEASE_S = 3600.0


def engine_hash(block: int) -> int:
    return block ^ 0x5A5A5A5A5A5A5A5A


@dataclass
class _ModelLease:
    worker: str
    epoch: int
    tier: Tier
    blocks: tuple[int, ...]  # the artifact's blocks
    owned: set[int]  # the ones it actually took


@dataclass
class _ModelWorker:
    seq: int | None = None
    engine: dict[int, int] = field(default_factory=dict)
    cached: set[tuple[int, Tier]] = field(default_factory=set)


class Model:
    """The Directory contract, written the slow and obvious way."""

    def __init__(self) -> None:
        self.epoch = 0
        self.leases: dict[int, _ModelLease] = {}
        self.replicas: set[tuple[int, str, Tier]] = set()
        self.sessions: dict[str, str] = {}
        self.forks: dict[int, set[str]] = {}
        self.workers: dict[str, _ModelWorker] = {}

    def owner_of(self, block: int) -> int | None:
        for aid, lease in self.leases.items():
            if block in lease.owned:
                return aid
        return None

    def claim(self, artifact: Artifact, worker: str) -> tuple[Any, ...]:
        aid = artifact.artifact_id
        holder = self.owner_of(aid)
        if holder is not None:
            h = self.leases[holder]
            return (holder, h.worker, h.epoch)
        self.epoch += 1
        owned = {b for b in artifact.blocks if self.owner_of(b) is None}
        self.leases[aid] = _ModelLease(worker, self.epoch, artifact.tier, artifact.blocks, owned)
        return (aid, worker, self.epoch)

    def check(self, aid: int, worker: str, epoch: int) -> _ModelLease:
        lease = self.leases.get(aid)
        if lease is None or (lease.worker, lease.epoch) != (worker, epoch):
            raise StaleEpochError("stale")
        return lease

    def release(self, aid: int, worker: str, epoch: int) -> None:
        if aid in self.leases:
            self.check(aid, worker, epoch)
            del self.leases[aid]

    def add_replica(
        self, aid: int, worker: str, tier: Tier, blocks: tuple[int, ...] | None
    ) -> None:
        if blocks is None:
            blocks = self.leases[aid].blocks if aid in self.leases else (aid,)
        for b in blocks:
            self.replicas.add((b, worker, tier))

    def transfer(
        self, chain: tuple[int, ...], src: str, dst: str, tier: Tier
    ) -> tuple[int, list[tuple[int, str, int]]]:
        """(blocks that changed owner, the leases handed over)."""
        if src == dst:
            raise InvalidRequestError("transfer to itself")
        self.add_replica(chain[-1], src, tier, chain)
        moving = [
            aid
            for aid, lease in self.leases.items()
            if lease.worker == src and set(lease.blocks) <= set(chain)
        ]
        if not moving:
            return 0, []
        self.epoch += 1
        for aid in moving:
            self.leases[aid].worker, self.leases[aid].epoch = dst, self.epoch
        changed = sum(1 for b in chain if self.owner_of(b) in moving)
        return changed, [(aid, dst, self.epoch) for aid in moving]

    def lookup(self, chain: tuple[int, ...], sid: str | None) -> Match:
        best: dict[tuple[str, Tier, HoldKind], int] = {}
        owner: tuple[int, str, int, int] | None = None  # depth, worker, epoch, id
        for aid, lease in self.leases.items():
            depths = [i + 1 for i, b in enumerate(chain) if b in lease.owned]
            if depths:
                d = max(depths)
                key = (lease.worker, lease.tier, HoldKind.OWNER)
                best[key] = max(best.get(key, 0), d)
                if owner is None or d > owner[0]:
                    owner = (d, lease.worker, lease.epoch, aid)
        for b, worker, tier in self.replicas:
            for i, c in enumerate(chain):
                if c == b:
                    key = (worker, tier, HoldKind.REPLICA)
                    best[key] = max(best.get(key, 0), i + 1)
        for name, w in self.workers.items():
            for tier in TIER_ORDER:
                k = 0
                while k < len(chain) and (chain[k], tier) in w.cached:
                    k += 1
                if k:
                    best[(name, tier, HoldKind.CACHED)] = k
        return Match(
            chain_len=len(chain),
            holdings=sort_holdings([Holding(w, t, b, kind) for (w, t, kind), b in best.items()]),
            owner=owner[1] if owner else None,
            owner_blocks=owner[0] if owner else 0,
            owner_epoch=owner[2] if owner else 0,
            session_owner=self.sessions.get(sid) if sid else None,
            owner_artifact_id=owner[3] if owner else None,
        )

    def apply(self, worker: str, batch: EventBatch) -> tuple[Any, ...]:
        w = self.workers.get(worker)
        if w is None:
            raise InvalidRequestError("unknown worker")
        if w.seq is not None and batch.seq <= w.seq:
            return ("dup", w.seq + 1)
        gap = w.seq is not None and batch.seq > w.seq + 1
        expected = w.seq + 1 if gap and w.seq is not None else None
        if gap:
            w.cached.clear()
            w.engine.clear()
        stored = removed = skipped = 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = (
                    ROOT if ev.parent_engine_hash is None else w.engine.get(ev.parent_engine_hash)
                )
                if parent is None:
                    skipped += len(ev.engine_hashes)
                    continue
                for k, e in enumerate(ev.engine_hashes):
                    parent = block_hash_chain(
                        ev.token_ids[k * BS : (k + 1) * BS], BS, ROOT, start_parent=parent
                    )[0]
                    w.cached.add((parent, ev.tier))
                    w.engine[e] = parent
                    stored += 1
            elif isinstance(ev, BlockRemoved):
                for e in ev.engine_hashes:
                    b = w.engine.get(e)
                    if b is None:
                        continue
                    if (b, ev.tier) in w.cached:
                        w.cached.discard((b, ev.tier))
                        removed += 1
                    if not any((b, t) in w.cached for t in TIER_ORDER):
                        del w.engine[e]
            elif isinstance(ev, AllBlocksCleared):
                w.cached.clear()
                w.engine.clear()
        w.seq = batch.seq
        return ("ok", stored, removed, gap, expected, skipped)

    def drop_worker(self, worker: str) -> int:
        n = 0
        for aid in [a for a, lease in self.leases.items() if lease.worker == worker]:
            del self.leases[aid]
            n += 1
        gone = {r for r in self.replicas if r[1] == worker}
        self.replicas -= gone
        n += len(gone)
        w = self.workers.get(worker)
        if w is not None:
            n += len({b for b, _ in w.cached})
            w.cached.clear()
            w.engine.clear()
            w.seq = None
        for sid in [s for s, o in self.sessions.items() if o == worker]:
            del self.sessions[sid]
            n += 1
        return n


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (StaleEpochError, InvalidRequestError) as exc:
        return type(exc).__name__


def _lease(lease: Lease) -> tuple[int, str, int]:
    return (lease.artifact_id, lease.worker, lease.epoch)


def _events(r: Any) -> tuple[Any, ...]:
    if r.duplicate:
        return ("dup", r.expected_seq)
    return ("ok", r.stored, r.removed, r.gap, r.expected_seq, r.skipped)


def make_machine(redis_url: str) -> type[RuleBasedStateMachine]:
    class DirectoryMachine(RuleBasedStateMachine):
        leases = Bundle("leases")

        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.memory = InMemoryDirectory()
            self.redis = RedisDirectory.from_url(
                redis_url, namespace=f"sm-{uuid.uuid4().hex[:10]}", socket_timeout_s=10.0
            )
            # the resilient wrapper, healthy, must answer like Redis, and its local mirror (what it
            # serves from during an outage) like the model
            self.resilient = ResilientDirectory(
                RedisDirectory.from_url(
                    redis_url, namespace=f"smr-{uuid.uuid4().hex[:10]}", socket_timeout_s=10.0
                )
            )
            self.model = Model()
            self.seq: dict[str, int] = {}

        def teardown(self) -> None:
            async def close() -> None:
                await self.redis.flush_namespace()
                await self.redis.close()
                await self.resilient.primary.flush_namespace()
                await self.resilient.close()

            self.loop.run_until_complete(close())
            self.loop.close()

        def both(self, call: Callable[[Any], Awaitable[Any]], norm: Callable[[Any], Any]) -> Any:
            async def run(d: Any) -> Any:
                try:
                    return norm(await call(d))
                except (StaleEpochError, InvalidRequestError) as exc:
                    return type(exc).__name__

            mem = self.loop.run_until_complete(run(self.memory))
            red = self.loop.run_until_complete(run(self.redis))
            res = self.loop.run_until_complete(run(self.resilient))
            assert mem == red == res, (mem, red, res)
            return mem

        @rule(
            target=leases,
            worker=st.sampled_from(WORKERS),
            c=st.integers(0, 1),
            end=st.integers(1, N),
            data=st.data(),
            tier=st.sampled_from(list(Tier)),
        )
        def claim(
            self, worker: str, c: int, end: int, data: Any, tier: Tier
        ) -> tuple[int, str, int]:
            start = data.draw(st.integers(0, end - 1))
            artifact = Artifact(CHAINS[c][:end], start=start, tier=tier)
            got = self.both(lambda d: d.claim(artifact, worker, LEASE_S), _lease)
            assert got == self.model.claim(artifact, worker)
            return got

        @rule(lease=leases, bump=st.sampled_from([0, 0, 1]))
        def renew(self, lease: tuple[int, str, int], bump: int) -> None:
            aid, worker, epoch = lease
            got = self.both(lambda d: d.renew(aid, worker, epoch + bump, LEASE_S), _lease)
            want = _outcome(lambda: _lease_of(self.model.check(aid, worker, epoch + bump), aid))
            assert got == want

        @rule(lease=leases, bump=st.sampled_from([0, 0, 1]))
        def release(self, lease: tuple[int, str, int], bump: int) -> None:
            aid, worker, epoch = lease
            got = self.both(lambda d: d.release(aid, worker, epoch + bump), lambda r: r)
            assert got == _outcome(lambda: self.model.release(aid, worker, epoch + bump))

        @rule(
            worker=st.sampled_from(WORKERS),
            tier=st.sampled_from(list(Tier)),
            c=st.integers(0, 1),
            end=st.integers(1, N),
            explicit=st.booleans(),
        )
        def add_replica(self, worker: str, tier: Tier, c: int, end: int, explicit: bool) -> None:
            aid = CHAINS[c][end - 1]
            blocks = CHAINS[c][:end] if explicit else None
            self.both(
                lambda d: d.add_replica(aid, worker, tier, LEASE_S, True, blocks), lambda r: r
            )
            self.model.add_replica(aid, worker, tier, blocks)

        @rule(
            target=leases,
            src=st.sampled_from(WORKERS),
            dst=st.sampled_from(WORKERS),
            c=st.integers(0, 1),
            end=st.integers(1, N),
            tier=st.sampled_from(list(Tier)),
        )
        def transfer(
            self, src: str, dst: str, c: int, end: int, tier: Tier
        ) -> MultipleResults[tuple[int, str, int]]:
            chain = CHAINS[c][:end]
            got = self.both(
                lambda d: d.transfer(chain, src, dst, LEASE_S, LEASE_S, tier), lambda r: r
            )
            want = _outcome(lambda: self.model.transfer(chain, src, dst, tier))
            if isinstance(want, str):
                assert got == want
                return multiple()
            assert got == want[0]
            return multiple(*want[1])

        @rule(sid=st.sampled_from(SESSIONS), worker=st.sampled_from(WORKERS))
        def set_session(self, sid: str, worker: str) -> None:
            self.both(lambda d: d.set_session_owner(sid, worker, LEASE_S), lambda r: r)
            self.model.sessions[sid] = worker

        @rule(
            c=st.integers(0, 1),
            end=st.integers(1, N),
            add=st.booleans(),
            sid=st.sampled_from(SESSIONS),
        )
        def fork(self, c: int, end: int, add: bool, sid: str) -> None:
            aid = CHAINS[c][end - 1]
            refs = self.model.forks.setdefault(aid, set())
            if add:
                refs.add(sid)
                got = self.both(lambda d: d.add_fork_ref(aid, sid), lambda r: r)
            else:
                refs.discard(sid)
                got = self.both(lambda d: d.drop_fork_ref(aid, sid), lambda r: r)
            assert got == len(refs)

        @rule(worker=st.sampled_from(WORKERS))
        def register(self, worker: str) -> None:
            self.both(lambda d: d.register_worker(worker, ROOT, BS), lambda r: r)
            self.model.workers.setdefault(worker, _ModelWorker())

        def events(self, worker: str, jump: int, *events: Any) -> None:
            seq = self.seq.get(worker, 0) + jump
            self.seq[worker] = max(seq, self.seq.get(worker, 0))
            batch = EventBatch(seq, 0.0, tuple(events))
            got = self.both(lambda d: d.apply_events(worker, batch), _events)
            assert got == _outcome(lambda: self.model.apply(worker, batch))

        @rule(
            worker=st.sampled_from(WORKERS),
            c=st.integers(0, 1),
            span=st.tuples(st.integers(0, N - 1), st.integers(1, N)),
            tier=st.sampled_from(list(Tier)),
            jump=st.sampled_from([1, 1, 1, 2, 0]),
        )
        def store(self, worker: str, c: int, span: tuple[int, int], tier: Tier, jump: int) -> None:
            k0, k1 = min(span), max(span)
            if k1 == k0:
                k1 += 1
            chain = CHAINS[c]
            parent = None if k0 == 0 else engine_hash(chain[k0 - 1])
            ev = BlockStored(
                tuple(engine_hash(b) for b in chain[k0:k1]),
                parent,
                tuple(TOKENS[c][k0 * BS : k1 * BS]),
                BS,
                tier,
            )
            self.events(worker, jump, ev)

        @rule(
            worker=st.sampled_from(WORKERS),
            c=st.integers(0, 1),
            k=st.integers(0, N - 1),
            tier=st.sampled_from(list(Tier)),
            jump=st.sampled_from([1, 1, 2]),
        )
        def remove(self, worker: str, c: int, k: int, tier: Tier, jump: int) -> None:
            self.events(worker, jump, BlockRemoved((engine_hash(CHAINS[c][k]),), tier))

        @rule(worker=st.sampled_from(WORKERS))
        def clear(self, worker: str) -> None:
            self.events(worker, 1, AllBlocksCleared())

        @rule(worker=st.sampled_from(WORKERS))
        def drop(self, worker: str) -> None:
            got = self.both(lambda d: d.drop_worker(worker), lambda r: r)
            assert got == self.model.drop_worker(worker)
            self.seq.pop(worker, None)

        @initialize()
        def register_some(self) -> None:
            for worker in WORKERS[:2]:  # w3 stays unregistered until a rule registers it
                self.register(worker)

        @invariant()
        def full_chains_agree(self) -> None:
            for chain in CHAINS:

                def call(d: Any, chain: tuple[int, ...] = chain) -> Awaitable[Any]:
                    return d.lookup(chain, "s1")

                want = self.model.lookup(chain, "s1")
                assert self.both(call, _same) == want
                mirror = self.loop.run_until_complete(self.resilient.local.lookup(chain, "s1"))
                assert mirror == want

        @invariant()
        def gpu_cached_counts_agree(self) -> None:
            gpu = [b for w in self.model.workers.values() for b, t in w.cached if t == Tier.GPU]
            want = CachedCounts(len(set(gpu)), len(gpu))
            assert self.both(lambda d: d.cached_counts(), _same) == want
            assert self.loop.run_until_complete(self.resilient.local.cached_counts()) == want

        @rule(c=st.integers(0, 1), end=st.integers(0, N), sid=st.sampled_from((None, *SESSIONS)))
        def lookup(self, c: int, end: int, sid: str | None) -> None:
            chain = CHAINS[c][:end]
            got = self.both(lambda d: d.lookup(chain, sid), lambda m: m)
            assert got == self.model.lookup(chain, sid)

    return DirectoryMachine


def _same(value: Any) -> Any:
    return value


def _lease_of(lease: _ModelLease, aid: int) -> tuple[int, str, int]:
    return (aid, lease.worker, lease.epoch)


def test_memory_and_redis_backends_match_the_model(redis_server: RedisServer) -> None:
    machine = make_machine(redis_server.url)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
