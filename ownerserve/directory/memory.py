"""The in-process ownership directory: the embedded default, and the Redis backend's reference.

Plain dicts in one process, same semantics as `RedisDirectory` (the shared contract suite runs
against both). Time comes from an injectable clock so tests can expire leases without sleeping.

With `cached_limit` the view of the workers' caches is bounded: past that many (block, worker)
pairs the coldest go (`InMemoryDirectory._evict`). `ResilientDirectory` bounds its local mirror
so; the embedded backend, the only view its router has, keeps every pair.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from operator import contains, ne
from typing import TypeVar

from ownerserve.directory.base import (
    Artifact,
    ArtifactInfo,
    CachedCounts,
    DirectoryHealth,
    EventApplyResult,
    Holding,
    HoldKind,
    Lease,
    Match,
)
from ownerserve.directory.common import (
    TIER_BIT,
    ReplicaEntryPoints,
    ReplicaWrite,
    TransferEntryPoints,
    TransferMove,
    check_artifact,
    check_holder,
    check_ttl,
    check_worker,
    holder_lapsed,
    holder_not_live,
    sort_holdings,
)
from ownerserve.directory.restorable import GroupHoldings, annotate
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import hash_block
from ownerserve.types import TIER_ORDER, Tier

SWEEP_SLICE = 4096
"""Records `InMemoryDirectory.sweep` handles between yields to the event loop."""
_GPU = TIER_BIT[Tier.GPU]
EVICT_TO = 7 / 8
"""An eviction brings the cached pairs down to this share of `cached_limit`, so it runs once
per eighth of the limit stored, not on every batch past it."""
_HELD = float("inf")
"""The expiry of a held replica line (`add_held_replicas`): it lives as its holder does."""

_ReplicaLine = tuple[float, bool, int]
"""A replica line: (expires at, read only, holder incarnation). Incarnation 0: a line with a
TTL of its own (`add_replica`); else a held line, expiring `_HELD`, live while its holder's
lease lives at that incarnation."""


_T = TypeVar("_T")


async def _slices(
    items: list[_T], clock: Callable[[], float]
) -> AsyncIterator[tuple[list[_T], float]]:
    """`items` in slices of `SWEEP_SLICE`, each with the time it starts at; the event loop runs
    between slices."""
    for i in range(0, len(items), SWEEP_SLICE):
        yield items[i : i + SWEEP_SLICE], clock()
        await asyncio.sleep(0)


class _ArtifactRecord:
    __slots__ = (
        "artifact_id",
        "blocks",
        "created_at",
        "epoch",
        "expires_at",
        "kv_type",
        "last_access",
        "mapped",
        "reuse_count",
        "size_bytes",
        "start",
        "tier",
        "worker",
    )

    def __init__(self, artifact: Artifact, worker: str, epoch: int, expires_at: float, now: float):
        self.artifact_id = artifact.artifact_id
        self.worker = worker
        self.epoch = epoch
        self.expires_at = expires_at
        self.tier = Tier(artifact.tier)
        self.start = artifact.start
        self.blocks = artifact.blocks
        self.size_bytes = artifact.size_bytes
        self.kv_type = artifact.kv_type
        self.created_at = now
        self.last_access = now
        self.reuse_count = 0
        self.mapped = 0
        """How many of `blocks` the directory maps to this artifact (all: no other artifact
        owns a block inside its range, so a lookup may skip the range)."""

    def lease(self) -> Lease:
        return Lease(self.artifact_id, self.worker, self.epoch, self.expires_at)


class _WorkerRecord:
    __slots__ = (
        "artifacts",
        "block_size",
        "counted",
        "engine_map",
        "replica_blocks",
        "root",
        "seq",
        "sessions",
    )

    def __init__(self, root: int, block_size: int) -> None:
        self.root = root
        self.block_size = block_size
        self.seq: int | None = None
        self.engine_map: dict[int, int] = {}  # engine hash -> OwnerServe block hash
        self.counted = 0
        """`len(engine_map)` as last added to `InMemoryDirectory._copies`."""
        self.artifacts: set[int] = set()
        self.replica_blocks: set[int] = set()
        self.sessions: set[str] = set()


@dataclass(slots=True)
class DirectorySnapshot:
    """Live state of an in-memory view (see `InMemoryDirectory.export_state`); lifetimes in
    seconds from now. The chain of a lease's artifact is only meaningful from `start` on."""

    registrations: dict[str, tuple[int, int]]
    leases: list[tuple[Artifact, Lease, float]]
    replicas: list[tuple[str, Tier, bool, float, tuple[int, ...]]]
    sessions: list[tuple[str, str, float]]
    forks: list[tuple[int, str]]
    cached: dict[str, list[tuple[int, int, int]]]
    holders: list[tuple[str, Tier, int, float]] = field(default_factory=list)
    """Live replica holders: worker, tier, incarnation, lease seconds left."""
    held: list[tuple[str, Tier, int, tuple[int, ...]]] = field(default_factory=list)
    """Their live lines: worker, tier, incarnation, blocks."""


class InMemoryDirectory(TransferEntryPoints, ReplicaEntryPoints):
    """`Directory` in one process. Not shared between router replicas: use Redis for that."""

    backend_name = "memory"

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        first_epoch: int = 1,
        cached_limit: int | None = None,
    ) -> None:
        if cached_limit is not None and cached_limit < 1:
            raise InvalidRequestError("cached_limit must be >= 1")
        self._clock = clock
        self._epoch = first_epoch - 1
        self._artifacts: dict[int, _ArtifactRecord] = {}
        self._owner_of_block: dict[int, int] = {}  # block -> artifact id
        self._replicas: dict[int, dict[tuple[str, Tier], _ReplicaLine]] = {}
        self._holders: dict[tuple[str, Tier], tuple[int, float]] = {}
        """(worker, tier) -> (incarnation, lease expiry) of each replica holder: one record
        however many lines it holds. Kept once the lease ended (as a tombstone: its
        incarnation is not revived) until `drop_worker` or the next incarnation."""
        self._cached: dict[int, dict[str, int]] = {}  # block -> worker -> tier bits
        self._workers: dict[str, _WorkerRecord] = {}
        self._worker_index: dict[str, _WorkerRecord] = {}  # every worker ever seen
        self._lives: dict[str, int] = {}  # worker -> times dropped (`worker_life`)
        self._sessions: dict[str, tuple[str, float]] = {}
        self._forks: dict[int, set[str]] = {}
        self.groups = GroupHoldings()
        """KV cache groups of workers serving hybrid models (restorable units)."""
        self._gpu_distinct = 0
        self._gpu_copies = 0
        """Blocks some worker caches on GPU, and (block, worker) GPU pairs (`cached_counts`):
        kept by `_set_cached` and `_uncache`, the only writers of
        `_cached`."""
        self.cached_limit = cached_limit
        """At most this many (block, worker) pairs of the workers' caches are kept (every
        engine hash mapped, any tier); None: no bound."""
        self._copies = 0
        """The engine hashes mapped, over every worker: the pairs `cached_limit` bounds."""
        self._recent: dict[str, tuple[int, ...]] = {}
        """The latest chain looked up per session, oldest first (`note_chain`): what an
        eviction spares. At most `cached_limit` blocks in all (`_recent_blocks`)."""
        self._recent_blocks = 0
        self.evicted = 0
        """(block, worker) pairs evicted past `cached_limit`, in all."""

    # --- helpers -----------------------------------------------------------------------

    def _worker(self, worker: str) -> _WorkerRecord:
        rec = self._worker_index.get(worker)
        if rec is None:
            rec = _WorkerRecord(0, 0)
            self._worker_index[worker] = rec
        return rec

    def _live(self, artifact_id: int | None, now: float) -> _ArtifactRecord | None:
        if artifact_id is None:
            return None
        rec = self._artifacts.get(artifact_id)
        return rec if rec is not None and rec.expires_at > now else None

    def _unmap(self, rec: _ArtifactRecord) -> None:
        for b in rec.blocks:
            if self._owner_of_block.get(b) == rec.artifact_id:
                del self._owner_of_block[b]
        rec.mapped = 0

    def _delete_artifact(self, rec: _ArtifactRecord) -> None:
        self._unmap(rec)
        del self._artifacts[rec.artifact_id]
        self._worker(rec.worker).artifacts.discard(rec.artifact_id)

    def _live_holders(self, now: float) -> dict[tuple[str, Tier], int]:
        """(worker, tier) -> incarnation of each holder whose lease lives at `now`."""
        return {k: inc for k, (inc, x) in self._holders.items() if x > now}

    @staticmethod
    def _line_live(
        key: tuple[str, Tier], line: _ReplicaLine, now: float, holders: dict[tuple[str, Tier], int]
    ) -> bool:
        """Whether a replica line counts at `now`: before its expiry, or, held, while its
        holder lives at its incarnation (`holders`: `_live_holders`)."""
        expires, _ro, inc = line
        return holders.get(key) == inc if inc else expires > now

    def _prune_replicas(
        self,
        block: int,
        entries: dict[tuple[str, Tier], _ReplicaLine],
        now: float,
        holders: dict[tuple[str, Tier], int] | None = None,
    ) -> int:
        """Delete `block`'s replica entries dead at `now` (expired, or held by a holder that
        is no longer live at their incarnation); workers left with none of it no longer list
        it (their index is what `drop_worker` undoes). Returns how many went."""
        if holders is None:
            holders = self._live_holders(now)
        live = self._line_live
        gone = [k for k, line in entries.items() if not live(k, line, now, holders)]
        for key in gone:
            del entries[key]
        for worker in {w for w, _ in gone if not any(k[0] == w for k in entries)}:
            self._worker(worker).replica_blocks.discard(block)
        return len(gone)

    def _set_cached(self, block: int, worker: str, bit: int, on: bool) -> bool:
        holders = self._cached.get(block)
        cur = holders.get(worker, 0) if holders else 0
        new = cur | bit if on else cur & ~bit
        if new == cur:
            return False
        if (cur ^ new) & _GPU:
            self._gpu_changed(holders, worker, 1 if new & _GPU else -1)
        if holders is None:
            holders = self._cached[block] = {}
        if new:
            holders[worker] = new
        else:
            del holders[worker]
            if not holders:
                del self._cached[block]
        return True

    def _gpu_changed(self, holders: dict[str, int] | None, worker: str, step: int) -> None:
        """`worker` starts (`step` 1) or stops (-1) caching a block on GPU whose holders were
        `holders`: one copy more or less, and one distinct block when no other worker caches
        it on GPU."""
        self._gpu_copies += step
        if not holders or not any(m & _GPU for w, m in holders.items() if w != worker):
            self._gpu_distinct += step

    def _uncache(self, block: int, worker: str) -> bool:
        """Forget that `worker` caches `block`, in every tier; whether it did."""
        holders = self._cached.get(block)
        mask = holders.get(worker, 0) if holders else 0
        if not mask:
            return False
        assert holders is not None
        if mask & _GPU:
            self._gpu_changed(holders, worker, -1)
        del holders[worker]
        if not holders:
            del self._cached[block]
        return True

    def _clear_cached(self, worker: str, rec: _WorkerRecord) -> int:
        n = sum(self._uncache(block, worker) for block in rec.engine_map.values())
        rec.engine_map.clear()
        self._copies -= rec.counted
        rec.counted = 0
        return n

    # --- the bound on the cached view (`cached_limit`) -----------------------------------

    @property
    def cached_pairs(self) -> int:
        """The (block, worker) pairs of the workers' caches kept (what `cached_limit`
        bounds)."""
        return self._copies

    def note_chain(self, session_id: str, chain: tuple[int, ...]) -> None:
        """`session_id` just looked `chain` up: an eviction spares its blocks before any
        other's (the sessions looked up last, first). Only with `cached_limit`; O(1): the tuple
        is kept, not copied (the router's is its tokenizer's, shared), at most `cached_limit`
        blocks over all sessions, the oldest sessions dropped past it."""
        limit = self.cached_limit
        if limit is None:
            return
        recent = self._recent
        old = recent.pop(session_id, None)
        if old is not None:
            self._recent_blocks -= len(old)
        recent[session_id] = chain
        self._recent_blocks += len(chain)
        while self._recent_blocks > limit and len(recent) > 1:
            first = next(iter(recent))
            self._recent_blocks -= len(recent.pop(first))

    def _recount(self, rec: _WorkerRecord) -> None:
        n = len(rec.engine_map)
        self._copies += n - rec.counted
        rec.counted = n

    def _evict_pair(self, worker: str, rec: _WorkerRecord, engine_hash: int, block: int) -> None:
        """Forget that `worker` caches `block` (every tier), and its engine hash."""
        del rec.engine_map[engine_hash]
        self._uncache(block, worker)

    def _evict(self) -> None:
        """Bring the cached pairs down to `EVICT_TO` of `cached_limit`: the coldest go, in
        the order each worker first stored them, except the blocks of the chains the latest
        sessions looked up (`note_chain`; at most half the target, newest first), which go
        only if the rest is not enough. A pair forgotten makes lookups miss from that block
        on, never credit a block the worker does not cache; a later event naming it as a
        parent is skipped here (Redis, which keeps every pair, maps it)."""
        assert self.cached_limit is not None
        target = int(self.cached_limit * EVICT_TO)
        spared: set[int] = set()
        for chain in reversed(self._recent.values()):
            if len(spared) + len(chain) > target // 2:
                break
            spared.update(chain)
        while self._copies > target:
            if self._evict_round(target, spared):
                continue
            if not spared:
                return  # nothing left to evict
            spared = set()  # the spared chains alone hold more than the target

    def _evict_round(self, target: int, spared: set[int]) -> int:
        """One round over the workers, each evicting its share of the excess (by how many
        pairs it holds), oldest stored first, the `spared` blocks skipped; how many went."""
        total = 0
        for worker, rec in self._workers.items():
            excess = self._copies - target
            if excess <= 0:
                break
            share = -(-excess * rec.counted // max(self._copies, 1))
            gone: list[tuple[int, int]] = []
            for engine_hash, block in rec.engine_map.items():
                if len(gone) >= share:
                    break
                if block not in spared:
                    gone.append((engine_hash, block))
            for engine_hash, block in gone:
                self._evict_pair(worker, rec, engine_hash, block)
            self._recount(rec)
            total += len(gone)
        self.evicted += total
        return total

    # --- the Directory protocol ----------------------------------------------------------

    async def register_worker(self, worker: str, model_root: int, block_size: int) -> None:
        check_worker(worker)
        if block_size <= 0:
            raise InvalidRequestError("block_size must be positive")
        rec = self._worker(worker)
        if worker in self._workers and (rec.root, rec.block_size) != (model_root, block_size):
            self._clear_cached(worker, rec)
            rec.seq = None
        rec.root, rec.block_size = model_root, block_size
        self._workers[worker] = rec
        self.groups.register_worker(worker, model_root, block_size)

    async def lookup(self, chain: Sequence[int], session_id: str | None = None) -> Match:
        now = self._clock()
        n = len(chain)
        session_owner = self._session(session_id, now) if session_id is not None else None
        if n == 0:
            return Match(chain_len=0, session_owner=session_owner)
        best: dict[tuple[str, Tier, HoldKind], int] = {}

        def hold(worker: str, tier: Tier, kind: HoldKind, blocks: int) -> None:
            key = (worker, tier, kind)
            if best.get(key, 0) < blocks:
                best[key] = blocks

        owner: _ArtifactRecord | None = None
        owner_blocks = 0
        # From the deepest block towards the root, one probe per block, except that an
        # artifact whose every block is still mapped to it has its whole range skipped (its
        # blocks cannot name another artifact): a session's chain of k turns costs about
        # k probes plus its new blocks, not one per block.
        if not isinstance(chain, tuple):
            chain = tuple(chain)
        own_get = self._owner_of_block.get
        owned = self._owner_of_block.__contains__
        artifacts = self._artifacts
        seen: set[int] = set()
        i = n - 1
        while i >= 0:
            aid = own_get(chain[i])
            if aid is None:
                # a stretch nobody owns (a turn's new blocks): the next owned block below is
                # found in C, not by a Python step per block
                below = map(owned, islice(reversed(chain), n - i, None))
                i = next(compress(range(i - 1, -1, -1), below), -1)
                continue
            if aid in seen:
                i -= 1
                continue
            seen.add(aid)
            rec = artifacts.get(aid)
            if rec is None:
                i -= 1
                continue
            if rec.expires_at > now:
                rec.last_access = now
                rec.reuse_count += 1
                hold(rec.worker, rec.tier, HoldKind.OWNER, i + 1)
                if owner is None:
                    owner, owner_blocks = rec, i + 1
            start = rec.start
            if (
                rec.mapped == len(rec.blocks)
                and start <= i
                and chain[start : i + 1] == rec.blocks[: i + 1 - start]
            ):
                i = start - 1
            else:
                i -= 1

        replicas = self._replicas
        if replicas:
            # the chain's replica lines, deepest first, found in C (no Python step per block:
            # a replica of an early prefix must not make every later lookup walk the chain)
            probes = list(map(replicas.get, reversed(chain)))  # the one probe per block
            lines = list(filter(None, probes))
            if lines:
                at = list(compress(range(n - 1, -1, -1), probes))
                live_holders = self._live_holders(now) if self._holders else {}
                # each (worker, tier) with a line on the chain holds the prefix down to its
                # deepest live line: found per holder by a C scan of the lines from the deepest
                for key in set().union(*lines):
                    has_key = map(contains, lines, repeat(key))
                    for i, entries in compress(zip(at, lines, strict=True), has_key):
                        expires, _ro, inc = entries[key]
                        if live_holders.get(key) == inc if inc else expires > now:
                            hold(key[0], key[1], HoldKind.REPLICA, i + 1)
                            break

        cached = self._cached
        alive = dict((cached.get(chain[0]) if cached else None) or {})
        length = n
        if alive and n > 1:
            cached_hits = list(map(cached.get, chain))
            # only where the holders change from the block before can a held prefix end:
            # those positions are found in C, not by a Python step per block
            for i in compress(range(1, n), map(ne, cached_hits[1:], cached_hits)):
                holders = cached_hits[i] or {}
                for worker, mask in list(alive.items()):
                    kept = mask & holders.get(worker, 0)
                    if kept != mask:
                        self._hold_cached(hold, worker, mask & ~kept, i)
                        if kept:
                            alive[worker] = kept
                        else:
                            del alive[worker]
                if not alive:
                    break
        for worker, mask in alive.items():
            self._hold_cached(hold, worker, mask, length)

        holdings = [Holding(w, t, b, k) for (w, t, k), b in best.items()]
        match = Match(
            chain_len=n,
            holdings=sort_holdings(holdings),
            owner=owner.worker if owner else None,
            owner_blocks=owner_blocks,
            owner_epoch=owner.epoch if owner else 0,
            session_owner=session_owner,
            owner_artifact_id=owner.artifact_id if owner else None,
        )
        return annotate(self.groups, match, chain)

    @staticmethod
    def _hold_cached(
        hold: Callable[[str, Tier, HoldKind, int], None], worker: str, mask: int, blocks: int
    ) -> None:
        for tier in TIER_ORDER:
            if mask & TIER_BIT[tier]:
                hold(worker, tier, HoldKind.CACHED, blocks)

    async def claim(
        self, artifact: Artifact, worker: str, lease_s: float, fence_epoch: int | None = None
    ) -> Lease:
        check_worker(worker)
        check_artifact(artifact)
        lease_s = check_ttl(lease_s)
        now = self._clock()
        if fence_epoch is not None:
            if artifact.start == 0:
                raise InvalidRequestError("a fenced claim extends a prefix: start must be > 0")
            parent = self._live(self._owner_of_block.get(artifact.chain[artifact.start - 1]), now)
            if parent is None or parent.worker != worker or parent.epoch != fence_epoch:
                raise StaleEpochError(
                    f"{worker} no longer owns the prefix at epoch {fence_epoch}"
                    f" (current epoch {parent.epoch if parent else 0})"
                )
        aid = artifact.artifact_id
        holder = self._live(self._owner_of_block.get(aid), now)
        if holder is not None:
            if holder.worker == worker and holder.artifact_id == aid:
                holder.expires_at = max(holder.expires_at, now + lease_s)
            return holder.lease()
        return self._install(artifact, worker, self._next_epoch(), now + lease_s, now)

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _install(
        self, artifact: Artifact, worker: str, epoch: int, expires_at: float, now: float
    ) -> Lease:
        aid = artifact.artifact_id
        old = self._artifacts.get(aid)
        reuse = 0
        if old is not None:
            reuse = old.reuse_count
            self._delete_artifact(old)
        rec = _ArtifactRecord(artifact, worker, epoch, expires_at, now)
        rec.reuse_count = reuse
        self._artifacts[aid] = rec
        own = self._owner_of_block
        mapped = 0
        if own.keys().isdisjoint(rec.blocks):
            # nothing of it is owned yet (a new prefix, a delta): map it all in one C call
            fresh = dict.fromkeys(rec.blocks, aid)
            own.update(fresh)
            rec.mapped = len(fresh)
            self._worker(worker).artifacts.add(aid)
            return rec.lease()
        for b in rec.blocks:
            cur = own.get(b)
            if cur is None:
                own[b] = aid
                mapped += 1
            elif cur != aid and self._live(cur, now) is None:
                own[b] = aid
                mapped += 1
                displaced = self._artifacts.get(cur)
                if displaced is not None:
                    displaced.mapped -= 1
        rec.mapped = mapped
        self._worker(worker).artifacts.add(aid)
        return rec.lease()

    def registration(self, worker: str) -> tuple[int, int] | None:
        """(chain root, block size) `worker` was registered with, if it was."""
        rec = self._workers.get(worker)
        return (rec.root, rec.block_size) if rec is not None else None

    def install_lease(self, artifact: Artifact | None, lease: Lease) -> None:
        """Mirror a lease decided elsewhere (by Redis) into this view, keeping its epoch.

        Used by `ResilientDirectory` so its local view knows the real epochs when Redis is
        unreachable; later local epochs stay above every mirrored one. Without `artifact`
        (a renew), an unknown lease is recorded on its last block only."""
        self._epoch = max(self._epoch, lease.epoch)
        now = self._clock()
        current = self._artifacts.get(lease.artifact_id)
        if current is not None and (current.worker, current.epoch) == (lease.worker, lease.epoch):
            current.expires_at = lease.expires_at
            return
        if artifact is None:
            artifact = Artifact((lease.artifact_id,))
        if lease.artifact_id != artifact.artifact_id:
            return  # the artifact is held through a longer one we may not know: skip
        self._install(artifact, lease.worker, lease.epoch, lease.expires_at, now)

    def export_state(self) -> DirectorySnapshot:
        """Everything live in this view, with remaining lifetimes: what a Redis that lost its
        data is refilled from."""
        now = self._clock()
        leases = [
            (
                Artifact(
                    (*([0] * r.start), *r.blocks),
                    start=r.start,
                    size_bytes=r.size_bytes,
                    kv_type=r.kv_type,
                    tier=r.tier,
                ),
                r.lease(),
                r.expires_at - now,
            )
            for r in self._artifacts.values()
            if r.expires_at > now
        ]
        replicas: dict[tuple[str, Tier, bool, float], list[int]] = {}
        holders = self._live_holders(now)
        held: dict[tuple[str, Tier, int], list[int]] = {}
        for block, entries in self._replicas.items():
            for (worker, tier), (expires, ro, inc) in entries.items():
                if inc:
                    if holders.get((worker, tier)) == inc:
                        held.setdefault((worker, tier, inc), []).append(block)
                elif expires > now:
                    replicas.setdefault((worker, tier, ro, expires), []).append(block)
        return DirectorySnapshot(
            registrations={w: (r.root, r.block_size) for w, r in self._workers.items()},
            leases=leases,
            replicas=[(w, t, ro, x - now, tuple(b)) for (w, t, ro, x), b in replicas.items()],
            sessions=[(s, w, x - now) for s, (w, x) in self._sessions.items() if x > now],
            forks=[(a, s) for a, refs in self._forks.items() for s in refs],
            cached={
                w: [(e, b, self._cached.get(b, {}).get(w, 0)) for e, b in r.engine_map.items()]
                for w, r in self._workers.items()
                if r.engine_map
            },
            holders=[(w, t, inc, x - now) for (w, t), (inc, x) in self._holders.items() if x > now],
            held=[(w, t, inc, tuple(b)) for (w, t, inc), b in held.items()],
        )

    async def renew(self, artifact_id: int, worker: str, epoch: int, lease_s: float) -> Lease:
        lease_s = check_ttl(lease_s)
        now = self._clock()
        rec = self._artifacts.get(artifact_id)
        if rec is None:
            raise StaleEpochError(f"artifact {artifact_id:016x} has no lease")
        if rec.worker != worker or rec.epoch != epoch:
            raise StaleEpochError(
                f"stale epoch {epoch} for {worker}: artifact is at epoch {rec.epoch}"
            )
        if rec.expires_at <= now:
            raise StaleEpochError(f"lease of {worker} at epoch {epoch} has expired")
        rec.expires_at = now + lease_s
        return rec.lease()

    async def release(self, artifact_id: int, worker: str, epoch: int) -> None:
        rec = self._artifacts.get(artifact_id)
        if rec is None:
            return
        if rec.worker != worker or rec.epoch != epoch:
            raise StaleEpochError(
                f"stale epoch {epoch} for {worker}: artifact is at epoch {rec.epoch}"
            )
        self._delete_artifact(rec)

    async def put_replica(self, write: ReplicaWrite) -> None:
        worker, blocks = write.worker, write.blocks
        now = self._clock()
        if blocks is None:
            rec = self._artifacts.get(write.artifact_id)
            blocks = rec.blocks if rec is not None else (write.artifact_id,)
        self._write_lines(worker, write.tier, (now + write.ttl_s, write.read_only, 0), blocks)

    def _write_lines(
        self, worker: str, tier: Tier, value: _ReplicaLine, blocks: Sequence[int]
    ) -> None:
        """`worker`'s line in `tier` of each of `blocks` becomes `value`."""
        key = (worker, tier)
        now = self._clock()
        replicas = self._replicas
        if replicas.keys().isdisjoint(blocks):
            # no line on any of them yet (a turn's new blocks): one new entry each, in C
            replicas.update(
                zip(blocks, map(dict.fromkeys, repeat((key,)), repeat(value)), strict=False)
            )
            self._worker(worker).replica_blocks.update(blocks)
            return
        for b in blocks:
            entries = replicas.get(b)
            if entries is None:
                replicas[b] = {key: value}
                continue
            if len(entries) >= 8:
                # dead entries are skipped by lookups and purged by `sweep`; prune them here
                # only when they pile up, not on every write
                self._prune_replicas(b, entries, now)
            entries[key] = value
        self._worker(worker).replica_blocks.update(blocks)

    async def renew_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> bool:
        tier = check_holder(worker, tier, incarnation)
        ttl_s = check_ttl(ttl_s, "ttl_s")
        key = (worker, tier)
        now = self._clock()
        cur = self._holders.get(key)
        if cur is not None and cur[0] == incarnation and cur[1] <= now:
            raise holder_lapsed(worker, tier, incarnation)
        self._holders[key] = (incarnation, now + ttl_s)
        return cur is not None and cur[0] == incarnation

    def install_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> None:
        """Mirror a holder lease decided elsewhere (by Redis): it lives at `incarnation` for
        `ttl_s` from now, whatever this view held."""
        self._holders[(worker, Tier(tier))] = (incarnation, self._clock() + ttl_s)

    async def add_held_replicas(
        self, worker: str, tier: Tier, incarnation: int, blocks: Sequence[int]
    ) -> None:
        tier = check_holder(worker, tier, incarnation)
        cur = self._holders.get((worker, tier))
        if cur is None or cur[0] != incarnation or cur[1] <= self._clock():
            raise holder_not_live(worker, tier, incarnation)
        self._write_lines(worker, tier, (_HELD, True, incarnation), blocks)

    async def drop_replicas(self, worker: str, tier: Tier, blocks: Sequence[int]) -> int:
        check_worker(worker)
        key = (worker, Tier(tier))
        dropped = 0
        index = self._worker(worker).replica_blocks
        for b in blocks:
            entries = self._replicas.get(b)
            if not entries or entries.pop(key, None) is None:
                continue
            dropped += 1
            if not any(k[0] == worker for k in entries):
                index.discard(b)
            if not entries:
                del self._replicas[b]
        return dropped

    async def move_leases(self, move: TransferMove) -> tuple[int, tuple[Lease, ...]]:
        chain, from_worker, to_worker = move.chain, move.from_worker, move.to_worker
        now = self._clock()
        own = self._owner_of_block
        in_chain = set(chain)
        seen: set[int] = set()
        moving: list[_ArtifactRecord] = []
        # a live artifact always maps its own last block, so the chain's owners name every
        # artifact that lies in it
        for b in chain:
            aid = own.get(b)
            if aid is None or aid in seen:
                continue
            seen.add(aid)
            rec = self._live(aid, now)
            if rec is not None and rec.worker == from_worker and in_chain.issuperset(rec.blocks):
                moving.append(rec)
        await self.add_replica(chain[-1], from_worker, move.tier, move.replica_ttl_s, True, chain)
        if not moving:
            return 0, ()
        epoch = self._next_epoch()
        expires_at = now + move.lease_s
        leases = tuple(self._hand_over(rec, to_worker, epoch, expires_at) for rec in moving)
        ids = {rec.artifact_id for rec in moving}
        return sum(own.get(b) in ids for b in chain), leases

    def _hand_over(self, rec: _ArtifactRecord, worker: str, epoch: int, expires_at: float) -> Lease:
        """Give a live artifact to another worker, blocks and history kept."""
        self._worker(rec.worker).artifacts.discard(rec.artifact_id)
        rec.worker, rec.epoch, rec.expires_at = worker, epoch, expires_at
        self._worker(worker).artifacts.add(rec.artifact_id)
        return rec.lease()

    async def install_transfer(
        self,
        chain: Sequence[int],
        from_worker: str,
        tier: Tier,
        replica_ttl_s: float,
        leases: Sequence[Lease],
    ) -> None:
        """Mirror a transfer decided elsewhere (by Redis) into this view: the leases it handed
        over, at their epochs (`install_holder`), and `from_worker`'s replica of `chain`."""
        for lease in leases:
            self.install_holder(lease)
        await self.add_replica(chain[-1], from_worker, tier, replica_ttl_s, True, chain)

    def install_holder(self, lease: Lease) -> None:
        """Mirror who holds an artifact, as decided elsewhere: a known artifact keeps the
        blocks this view maps to it and takes the lease's worker, epoch and expiry; an unknown
        one is recorded as `install_lease` does."""
        self._epoch = max(self._epoch, lease.epoch)
        rec = self._artifacts.get(lease.artifact_id)
        if rec is None:
            self.install_lease(None, lease)
        else:
            self._hand_over(rec, lease.worker, lease.epoch, lease.expires_at)

    def _session(self, session_id: str, now: float) -> str | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._sessions[session_id]
            self._worker(entry[0]).sessions.discard(session_id)
            return None
        return entry[0]

    async def set_session_owner(self, session_id: str, worker: str, ttl_s: float) -> None:
        check_worker(worker)
        ttl_s = check_ttl(ttl_s, "ttl_s")
        old = self._sessions.get(session_id)
        if old is not None and old[0] != worker:
            self._worker(old[0]).sessions.discard(session_id)
        self._sessions[session_id] = (worker, self._clock() + ttl_s)
        self._worker(worker).sessions.add(session_id)

    async def get_session_owner(self, session_id: str) -> str | None:
        return self._session(session_id, self._clock())

    async def add_fork_ref(self, artifact_id: int, session_id: str) -> int:
        refs = self._forks.setdefault(artifact_id, set())
        refs.add(session_id)
        return len(refs)

    async def drop_fork_ref(self, artifact_id: int, session_id: str) -> int:
        refs = self._forks.get(artifact_id)
        if refs is None:
            return 0
        refs.discard(session_id)
        if not refs:
            del self._forks[artifact_id]
        return len(refs)

    async def apply_events(
        self, worker: str, batch: EventBatch, life: int | None = None
    ) -> EventApplyResult:
        rec = self._workers.get(worker)
        if rec is None:
            raise InvalidRequestError(f"worker {worker!r} is not registered with the directory")
        current = self._lives.get(worker, 0)
        if life is not None and current > life:
            return EventApplyResult(fenced=current)
        last = rec.seq
        if last is not None and batch.seq <= last:
            return EventApplyResult(duplicate=True, expected_seq=last + 1)
        gap = last is not None and batch.seq > last + 1
        if gap:
            self._clear_cached(worker, rec)
            self.groups.clear(worker)
        batch = self.groups.split(worker, batch)
        stored = removed = skipped = unknown_parent = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                n = len(event.engine_hashes)
                if event.block_size != rec.block_size or len(event.token_ids) != n * rec.block_size:
                    skipped += n
                    continue
                if event.parent_engine_hash is None:
                    parent: int | None = rec.root
                else:
                    parent = rec.engine_map.get(event.parent_engine_hash)
                if parent is None:
                    skipped += n
                    unknown_parent += n
                    continue
                bit = TIER_BIT[Tier(event.tier)]
                bs = rec.block_size
                for k, engine_hash in enumerate(event.engine_hashes):
                    parent = hash_block(parent, event.token_ids[k * bs : (k + 1) * bs])
                    self._set_cached(parent, worker, bit, True)
                    rec.engine_map[engine_hash] = parent
                    stored += 1
            elif isinstance(event, BlockRemoved):
                bit = TIER_BIT[Tier(event.tier)]
                for engine_hash in event.engine_hashes:
                    block = rec.engine_map.get(engine_hash)
                    if block is None:
                        continue
                    if self._set_cached(block, worker, bit, False):
                        removed += 1
                    if not self._cached.get(block, {}).get(worker):
                        del rec.engine_map[engine_hash]
            elif isinstance(event, AllBlocksCleared):
                self._clear_cached(worker, rec)
        rec.seq = batch.seq
        self._recount(rec)
        if self.cached_limit is not None and self._copies > self.cached_limit:
            self._evict()
        return EventApplyResult(
            stored=stored,
            removed=removed,
            gap=gap,
            expected_seq=last + 1 if gap and last is not None else None,
            skipped=skipped,
            unknown_parent=unknown_parent,
        )

    async def worker_life(self, worker: str) -> int:
        return self._lives.get(worker, 0)

    async def drop_worker(self, worker: str, life: int | None = None) -> int:
        current = self._lives.get(worker, 0)
        if life is not None and current > life:
            return 0  # that life was dropped already
        self._lives[worker] = current + 1
        self.groups.drop_worker(worker)
        rec = self._worker_index.get(worker)
        if rec is None:
            return 0
        dropped = 0
        for aid in list(rec.artifacts):
            art = self._artifacts.get(aid)
            if art is not None and art.worker == worker:
                self._delete_artifact(art)
                dropped += 1
        rec.artifacts.clear()
        for b in rec.replica_blocks:
            entries = self._replicas.get(b)
            if not entries:
                continue
            for key in [k for k in entries if k[0] == worker]:
                del entries[key]
                dropped += 1
            if not entries:
                del self._replicas[b]
        rec.replica_blocks.clear()
        for key, (inc, _) in list(self._holders.items()):
            if key[0] == worker:  # ended, kept as a tombstone: the incarnation is not revived
                self._holders[key] = (inc, -_HELD)
        dropped += self._clear_cached(worker, rec)
        now = self._clock()
        for sid in rec.sessions:
            entry = self._sessions.get(sid)
            if entry is not None and entry[0] == worker:
                del self._sessions[sid]
                dropped += entry[1] > now
        rec.sessions.clear()
        rec.seq = None
        return dropped

    async def artifact_info(self, artifact_id: int) -> ArtifactInfo | None:
        rec = self._artifacts.get(artifact_id)
        if rec is None:
            return None
        return ArtifactInfo(
            artifact_id=rec.artifact_id,
            worker=rec.worker,
            epoch=rec.epoch,
            expires_at=rec.expires_at,
            live=rec.expires_at > self._clock(),
            start=rec.start,
            blocks=len(rec.blocks),
            size_bytes=rec.size_bytes,
            kv_type=rec.kv_type,
            tier=rec.tier,
            created_at=rec.created_at,
            last_access=rec.last_access,
            reuse_count=rec.reuse_count,
            fork_refs=len(self._forks.get(artifact_id, ())),
        )

    async def sweep(self, min_interval_s: float = 0.0) -> int:
        """Purge expired leases, replicas and sessions, the fork refs of sessions that ended
        (they count live branches), and the per-worker index entries that pointed at them.
        Works through `SWEEP_SLICE` records at a time and yields to the event loop between
        slices, so a large directory does not stall the router; each record is checked again
        when its slice runs. `min_interval_s` does not apply: one process, one sweeper."""
        dropped = 0
        clock = self._clock
        async for ids, now in _slices(list(self._artifacts), clock):
            for aid in ids:
                rec = self._artifacts.get(aid)
                if rec is not None and rec.expires_at <= now:
                    self._delete_artifact(rec)
                    dropped += 1
        async for ids, now in _slices(list(self._forks), clock):
            for aid in ids:
                refs = self._forks.get(aid)
                if refs is None:
                    continue
                refs.difference_update([s for s in refs if self._session(s, now) is None])
                if not refs:
                    del self._forks[aid]
        async for blocks, now in _slices(list(self._replicas), clock):
            holders = self._live_holders(now)
            for b in blocks:
                entries = self._replicas.get(b)
                if entries is None:
                    continue
                dropped += self._prune_replicas(b, entries, now, holders)
                if not entries:
                    del self._replicas[b]
        # sessions expire on their own (as Redis keys do): purged here, not counted
        async for sids, now in _slices(list(self._sessions), clock):
            for sid in sids:
                self._session(sid, now)
        return dropped

    async def cached_counts(self) -> CachedCounts:
        return CachedCounts(self._gpu_distinct, self._gpu_copies)

    async def health(self) -> DirectoryHealth:
        return DirectoryHealth(
            backend=self.backend_name,
            healthy=True,
            stats={
                "artifacts": len(self._artifacts),
                "owned_blocks": len(self._owner_of_block),
                "cached_blocks": len(self._cached),
                "cached_pairs": self._copies,
                "cached_evicted": self.evicted,
                "replica_blocks": len(self._replicas),
                "replica_holders": len(self._holders),
                "sessions": len(self._sessions),
                "workers": len(self._workers),
                "epoch": self._epoch,
            },
        )

    async def close(self) -> None:
        return None
