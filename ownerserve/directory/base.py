"""The `Directory` contract and its value types, shared by every backend.

Ownership is per sealed block of a hash chain (`ownerserve.hashing`). An `Artifact` is an
immutable run of blocks `[start, end)` of one chain: the first artifact of a session starts at
block 0, later turns append delta artifacts (single-owner rule 1). An artifact's id is the hash of
its last block, which names the whole prefix up to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from ownerserve.directory.restorable import RestorableUnit
from ownerserve.events import EventBatch
from ownerserve.records import fast_init
from ownerserve.types import Tier


class HoldKind(StrEnum):
    """Why a worker holds a prefix: it owns it (lease), holds a read-only replica, or merely
    has it cached according to its KV events."""

    OWNER = "owner"
    REPLICA = "replica"
    CACHED = "cached"


@fast_init
@dataclass(frozen=True, slots=True)
class Artifact:
    """An immutable run of blocks `chain[start:]` of a prefix chain, plus its metadata."""

    chain: tuple[int, ...]
    start: int = 0
    size_bytes: int = 0
    kv_type: str = "dense"
    tier: Tier = Tier.GPU

    @property
    def artifact_id(self) -> int:
        return self.chain[-1]

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.chain[self.start :]


@fast_init
@dataclass(frozen=True, slots=True)
class Lease:
    """Ownership of an artifact by `worker` until `expires_at` (unix seconds), fenced by `epoch`."""

    artifact_id: int
    worker: str
    epoch: int
    expires_at: float


@fast_init
@dataclass(frozen=True, slots=True)
class Holding:
    """`worker` holds the first `blocks` blocks of the looked-up chain in `tier`."""

    worker: str
    tier: Tier
    blocks: int
    kind: HoldKind


@fast_init
@dataclass(frozen=True, slots=True)
class Match:
    """Answer of one `lookup`: every worker's longest held prefix per tier, the owner of the
    longest owned prefix, and the session's decode owner."""

    chain_len: int
    holdings: tuple[Holding, ...] = ()
    owner: str | None = None
    owner_blocks: int = 0
    owner_epoch: int = 0
    session_owner: str | None = None
    owner_artifact_id: int | None = None
    """Id of the artifact holding the deepest owned block: what `renew` takes."""
    restorable: tuple[RestorableUnit, ...] = ()
    """For workers serving a hybrid-attention model (group-tagged KV events): per worker and
    tier, the deepest boundary where every KV cache group can be restored, and where the
    attention groups alone reach (`ownerserve.directory.restorable`); () otherwise."""

    def restorable_on(self, worker: str, tier: Tier = Tier.GPU) -> RestorableUnit | None:
        """What `worker` can restore from `tier`, if it serves a hybrid model."""
        for u in self.restorable:
            if u.worker == worker and u.tier == tier:
                return u
        return None

    def longest(self, worker: str, tier: Tier | None = None) -> int:
        """Longest prefix (blocks) `worker` holds, in `tier` or in any tier."""
        best = 0
        for h in self.holdings:
            if h.worker == worker and (tier is None or h.tier == tier) and h.blocks > best:
                best = h.blocks
        return best


@dataclass(frozen=True, slots=True)
class EventApplyResult:
    """What `apply_events` did: blocks added/removed, and whether a sequence gap was seen
    (the caller should then resync the worker, e.g. by `drop_worker` + replay)."""

    stored: int = 0
    removed: int = 0
    gap: bool = False
    expected_seq: int | None = None
    skipped: int = 0
    """Stored blocks that could not be mapped (unknown parent, block size mismatch)."""
    unknown_parent: int = 0
    """Of `skipped`: blocks continuing a chain the directory does not know, as after it
    forgot the worker's blocks (its death, an event gap) while its engine kept them."""
    duplicate: bool = False
    """The batch's seq was already applied (another router replica fed it first): ignored."""
    fenced: int | None = None
    """The batch was of a life the directory has dropped since: ignored. The worker's
    current life (`Directory.worker_life`)."""


@dataclass(frozen=True, slots=True)
class ArtifactInfo:
    """What the directory knows about one artifact: its lease and its metadata."""

    artifact_id: int
    worker: str
    epoch: int
    expires_at: float
    live: bool
    start: int = 0
    blocks: int = 0
    size_bytes: int = 0
    kv_type: str = "dense"
    tier: Tier = Tier.GPU
    created_at: float = 0.0
    last_access: float = 0.0
    reuse_count: int = 0
    fork_refs: int = 0


@dataclass(frozen=True, slots=True)
class CachedCounts:
    """How much the workers' KV events say they cache on GPU, over all workers: `distinct`
    blocks cached by at least one worker, `copies` the (block, worker) pairs (each worker's
    GPU blocks, summed). `copies / distinct` is the HBM duplicate factor."""

    distinct: int = 0
    copies: int = 0


@dataclass(frozen=True, slots=True)
class DirectoryHealth:
    backend: str
    healthy: bool
    detail: str = ""
    pending_reconcile: int = 0
    stats: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Directory(Protocol):
    """The single source of truth for KV ownership, shared by every router replica.

    Every method is one round trip to the backend. Writes carrying an epoch older than the
    artifact's current epoch raise `StaleEpochError` (fencing).
    """

    async def register_worker(self, worker: str, model_root: int, block_size: int) -> None:
        """Tell the directory which chain root (`ownerserve.hashing.chain_root`) and block size
        a worker's KV events use, so their token ids map onto OwnerServe's hash chain."""
        ...

    async def lookup(self, chain: Sequence[int], session_id: str | None = None) -> Match:
        """Longest held prefix of `chain` per worker and tier, its owner, the session owner."""
        ...

    async def claim(
        self, artifact: Artifact, worker: str, lease_s: float, fence_epoch: int | None = None
    ) -> Lease:
        """Atomically make `worker` owner of the artifact's unowned (or lease-expired) blocks.

        Returns the lease; if another live owner holds the artifact, returns *its* lease
        (the caller compares `lease.worker`). With `fence_epoch`, the claim is a commit of a
        delta (`artifact.start > 0`) by the owner of the prefix it extends: it raises
        `StaleEpochError` unless `worker` still holds block `start - 1` at that epoch."""
        ...

    async def renew(self, artifact_id: int, worker: str, epoch: int, lease_s: float) -> Lease:
        """Extend a lease held by `worker` at `epoch`; stale epoch raises `StaleEpochError`."""
        ...

    async def release(self, artifact_id: int, worker: str, epoch: int) -> None:
        """Give up ownership; the blocks become claimable."""
        ...

    async def add_replica(
        self,
        artifact_id: int,
        worker: str,
        tier: Tier,
        ttl_s: float,
        read_only: bool = True,
        blocks: Sequence[int] | None = None,
    ) -> None:
        """Record a (read-only) copy of the artifact's prefix on `worker` that expires.

        `blocks` are the hashes the copy covers (e.g. the whole chain up to the artifact);
        by default the artifact's own blocks (or just its id if it was never claimed)."""
        ...

    async def renew_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> bool:
        """Start or extend the liveness lease of `worker`'s replica holder in `tier` (a KV
        sidecar publishing its blocks): one record, whatever the blocks, so renewing it is
        O(1). The lines `add_held_replicas` writes count in lookups only while this lease
        lives at the incarnation they were written with.

        `incarnation` is the holder's id for one continuous life (a positive integer the
        holder picks at random when it starts one). Returns True when it extended the live
        lease of that incarnation; False when it started one: there was no lease, or another
        incarnation's (a restarted holder supersedes its dead predecessor, whose lines count
        no more at once). An incarnation whose lease lapsed or was ended (`drop_worker`) is
        not revived, since `sweep` may have purged part of its lines: that raises
        `StaleEpochError`, and the holder starts a new incarnation and writes its lines again."""
        ...

    async def add_held_replicas(
        self, worker: str, tier: Tier, incarnation: int, blocks: Sequence[int]
    ) -> None:
        """Record read-only copies of `blocks` on `worker` in `tier` that live as long as its
        replica holder's lease at `incarnation` (`renew_replica_holder`), not by a TTL of
        their own. Raises `StaleEpochError` unless that lease lives at that incarnation. A
        block's line per worker and tier is one: this replaces an `add_replica` line there,
        and is replaced by one."""
        ...

    async def drop_replicas(self, worker: str, tier: Tier, blocks: Sequence[int]) -> int:
        """Withdraw `worker`'s replica lines of `blocks` in `tier` now (held or with a TTL):
        a holder that lost blocks says so. Returns how many lines went."""
        ...

    async def transfer(
        self,
        chain: Sequence[int],
        from_worker: str,
        to_worker: str,
        lease_s: float,
        replica_ttl_s: float,
        tier: Tier = Tier.GPU,
    ) -> int:
        """Hand the prefix `chain` over from `from_worker` to `to_worker` (after a state
        migration): every artifact of `from_worker` with a live lease whose blocks all lie in
        `chain` becomes `to_worker`'s at one new epoch (so a late fenced write by `from_worker`
        raises `StaleEpochError`) with a lease of `lease_s`; an artifact that reaches past
        `chain` stays with `from_worker`. `from_worker` keeps a read-only replica of `chain` in
        `tier` expiring after `replica_ttl_s`. Returns the number of blocks that changed owner
        (0 when `from_worker` owned none of it: then nothing changes but the replica)."""
        ...

    async def artifact_info(self, artifact_id: int) -> ArtifactInfo | None:
        """The artifact's lease and metadata, or None if it was never claimed or released."""
        ...

    async def sweep(self, min_interval_s: float = 0.0) -> int:
        """Garbage-collect expired leases and replicas (replica lines whose holder's lease
        ended, or that another incarnation superseded, included); returns how many records
        went. With
        `min_interval_s` > 0 a backend shared by several routers sweeps only when no sweep
        began within that time (the others return 0 at once)."""
        ...

    async def set_session_owner(self, session_id: str, worker: str, ttl_s: float) -> None: ...

    async def get_session_owner(self, session_id: str) -> str | None: ...

    async def add_fork_ref(self, artifact_id: int, session_id: str) -> int:
        """A forked branch starts sharing the artifact copy-on-write; returns the ref count."""
        ...

    async def drop_fork_ref(self, artifact_id: int, session_id: str) -> int: ...

    async def apply_events(
        self, worker: str, batch: EventBatch, life: int | None = None
    ) -> EventApplyResult:
        """Apply a worker's KV event batch (stores/evictions/clears) with gap detection.

        `life`: the worker's `worker_life` when the caller last saw it alive. Once that life
        was dropped the batch is refused (`EventApplyResult.fenced`): it was published before
        the death (queued in a subscription, or held back by a Redis outage) and must not
        name the dead life's blocks in the next one. None: any life (a caller with one view)."""
        ...

    async def drop_worker(self, worker: str, life: int | None = None) -> int:
        """Owner death: forget everything `worker` held; its artifacts become claimable and
        its sessions lose their owner. Returns how many records were dropped.

        `life`: the worker's `worker_life` when the caller last saw it alive. A drop ends that
        life (the count goes up); a caller whose view is older (another router replica
        dropped that life already, and the worker may be back, recording anew) drops nothing.
        None: drop whatever life it is in (a worker taken out by hand)."""
        ...

    async def worker_life(self, worker: str) -> int:
        """How many times `worker` was dropped (0 for one never dropped): read when it is
        seen alive, passed to `drop_worker` when it dies."""
        ...

    async def cached_counts(self) -> CachedCounts:
        """The GPU-cached blocks, distinct and copies (`CachedCounts`), over every worker:
        kept as the cached bits change (a store, a removal, a dropped view), so a read is one
        round trip whatever the directory holds."""
        ...

    async def health(self) -> DirectoryHealth: ...

    async def close(self) -> None: ...
