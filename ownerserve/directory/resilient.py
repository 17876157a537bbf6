"""A directory that keeps serving when Redis is unreachable, and reconciles when it returns.

`ResilientDirectory` sends every call to the primary (Redis) and mirrors each write into a
local in-memory view. On a connection error it answers from the local view, queues the
writes, and retries Redis in the background. The view's copy of the workers' caches is bounded
(`mirror_cached_blocks` (block, worker) pairs, `directory.mirror_cached_blocks`): past it the
coldest go, the chains the latest sessions looked up kept longest, so a router's memory does not
grow with the cluster's KV capacity (the mirror was its largest growth in the 30-minute chaos
run); a cached view is a routing hint, so what it forgot costs prefix misses during an outage
and after a lost dataset, never a wrong owner. When Redis answers again:

- same dataset (its boot token is unchanged): the queued writes are replayed in order;
  leases claimed meanwhile get real epochs, and the provisional epochs handed out during the
  outage (all >= `PROVISIONAL_EPOCH_BASE`) are translated on later renew/release/claim calls;
- dataset lost (restart without persistence): the epoch counter is raised above every epoch
  seen, then the whole local view (workers, cached blocks, leases, replicas, replica holders
  and their lines, sessions, fork refs) is pushed back; old epochs are translated the same
  way.

While the queued writes are replayed, new writes wait for the replay to end (up to
`catch_up_wait_s`, then they queue behind it): a replay is one round trip a write, and writes
that went on queueing at the local view's speed outran it, so a router under load never got
back to Redis (seen: 29,858 writes queued after 12 minutes, from one 1 s timeout).

Ownership decided during an outage (claims, transfers) is provisional: another router may have
claimed the same artifact; on replay the primary's answer wins and the loser's later writes get
`StaleEpochError`. `health()` reports the pending writes and the conflicts seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ClusterDownError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ownerserve.directory.base import (
    Artifact,
    ArtifactInfo,
    CachedCounts,
    DirectoryHealth,
    EventApplyResult,
    Lease,
    Match,
)
from ownerserve.directory.common import (
    ReplicaEntryPoints,
    ReplicaWrite,
    TransferEntryPoints,
    TransferMove,
)
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory
from ownerserve.errors import InvalidRequestError, OwnerServeError, StaleEpochError
from ownerserve.events import EventBatch
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import Tier

log = logging.getLogger(__name__)

PROVISIONAL_EPOCH_BASE = 1 << 62
"""Epochs the local view hands out during an outage start here, far above Redis's counter."""

UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    RedisClusterException,
    ClusterDownError,
    OSError,
    TimeoutError,
)
"""Errors that mean "Redis is unreachable" (not "Redis said no")."""

CATCH_UP_WAIT_S = 5.0
"""How long a write waits for the replay of the queued writes to end before it queues behind
them (`ResilientDirectory.catch_up_wait_s`)."""
EPOCH_MAP_GRACE_S = 60.0
"""An epoch translation is kept this long past the end of the lease it leads to (a holder's
late release; the router's clock against Redis's, whose leases' expiries it reads)."""
MIRROR_CACHED_BLOCKS = 65_536
"""By default (`directory.mirror_cached_blocks`), the (block, worker) pairs of the workers'
caches the local view keeps (~220 B each: ~14 MB)."""
EPOCH_MAP_MIN_PRUNE = 1024
"""The epoch translations are pruned once they are twice as many as after the last pruning,
and at least this many."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """One write done locally while Redis was unreachable, to replay later."""

    op: str
    args: tuple[Any, ...]
    local_result: Any = None


class ResilientDirectory(TransferEntryPoints, ReplicaEntryPoints):
    """`Directory` over a Redis primary with a local fallback view (see the module doc)."""

    backend_name = "redis+local"

    def __init__(
        self,
        primary: RedisDirectory,
        fallback: InMemoryDirectory | None = None,
        *,
        retry_interval_s: float = 0.5,
        max_pending: int = 100_000,
        boot_check_s: float = 1.0,
        epoch_grace_s: float = EPOCH_MAP_GRACE_S,
        epoch_map_min: int = EPOCH_MAP_MIN_PRUNE,
        catch_up_wait_s: float = CATCH_UP_WAIT_S,
        mirror_cached_blocks: int | None = MIRROR_CACHED_BLOCKS,
    ) -> None:
        """`mirror_cached_blocks`: the bound of the local view's cached pairs (None: none);
        a `fallback` given keeps its own."""
        self.primary = primary
        self.local = fallback or InMemoryDirectory(
            first_epoch=PROVISIONAL_EPOCH_BASE, cached_limit=mirror_cached_blocks
        )
        self.retry_interval_s = retry_interval_s
        self.max_pending = max_pending
        self.boot_check_s = boot_check_s
        self._boot_checked_at = 0.0
        self._healthy = True
        self._last_error = ""
        self._pending: deque[_Pending] = deque()
        self._lock = asyncio.Lock()
        self._epoch_map: dict[int, int] = {}  # provisional or pre-loss epoch -> Redis epoch
        self._epoch_ends: dict[int, float] = {}
        """Each Redis epoch `_epoch_map` leads to: the latest end seen of its leases (a
        translation matters only while they may be live)."""
        self.epoch_grace_s = epoch_grace_s
        self.epoch_map_min = epoch_map_min
        self._prune_epochs_at = epoch_map_min
        self._max_primary_epoch = 0
        self.catch_up_wait_s = catch_up_wait_s
        self._caught_up: asyncio.Event | None = None
        """Set while Redis answers and the queued writes are being replayed; new writes wait
        on it (`_wait_catch_up`)."""
        self._boot: str | None = None
        self._reconnect: asyncio.Task[None] | None = None
        self._closed = False
        self.stats: dict[str, int] = {
            "outages": 0,
            "local_calls": 0,
            "replayed": 0,
            "conflicts": 0,
            "dropped": 0,
            "resyncs": 0,
        }

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- plumbing -------------------------------------------------------------------------

    def _epoch(self, epoch: int) -> int:
        return self._epoch_map.get(epoch, epoch)

    def _translate(self, old: int, lease: Lease) -> None:
        """From now on `old` (a provisional or pre-loss epoch) means `lease`'s epoch, while
        its leases may be live: the translations whose leases all ended `epoch_grace_s` ago
        go, in a pruning each time the map has doubled (at least `epoch_map_min`; amortized
        O(1) a translation), so the map holds those of live leases, and at most as many
        again."""
        self._epoch_map[old] = lease.epoch
        ends = self._epoch_ends
        ends[lease.epoch] = max(ends.get(lease.epoch, 0.0), lease.expires_at)
        if len(self._epoch_map) < self._prune_epochs_at:
            return
        cutoff = time.time() - self.epoch_grace_s
        self._epoch_map = {
            k: v for k, v in self._epoch_map.items() if ends.get(v, float("inf")) > cutoff
        }
        kept = set(self._epoch_map.values())
        self._epoch_ends = {e: x for e, x in ends.items() if e in kept}
        self._prune_epochs_at = max(self.epoch_map_min, 2 * len(self._epoch_map))

    def _seen(self, lease: Lease) -> Lease:
        if lease.epoch in self._epoch_ends:  # renewed: its translations live as long
            self._epoch_ends[lease.epoch] = max(self._epoch_ends[lease.epoch], lease.expires_at)
        if lease.epoch < PROVISIONAL_EPOCH_BASE:
            self._max_primary_epoch = max(self._max_primary_epoch, lease.epoch)
        return lease

    def _mark_down(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        if self._healthy:
            self._healthy = False
            self.stats["outages"] += 1
            log.warning("directory: Redis unreachable (%s); serving from the local view", exc)
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop())

    async def _ensure_boot(self) -> None:
        """Learn the dataset's boot token, and re-check it at most every `boot_check_s`: a
        restart without persistence that redis-py's own retries hid from us shows up as a new
        token, and the local view is pushed back (a window of at most `boot_check_s` in which
        writes reached the empty dataset)."""
        now = time.monotonic()
        if self._boot is not None and now - self._boot_checked_at < self.boot_check_s:
            return
        self._boot_checked_at = now
        token = await self.primary.boot_token(uuid.uuid4().hex)
        if self._boot is not None and token != self._boot:
            log.warning("directory: Redis lost its data unnoticed; pushing the local view back")
            async with self._lock:
                await self._resync()
        self._boot = token

    async def _read(
        self, primary: Callable[[], Awaitable[Any]], local: Callable[[], Awaitable[Any]]
    ) -> Any:
        if self._healthy:
            try:
                return await primary()
            except UNREACHABLE as exc:
                self._mark_down(exc)
        self.stats["local_calls"] += 1
        return await local()

    async def _write(
        self,
        op: str,
        args: tuple[Any, ...],
        primary: Callable[[], Awaitable[Any]],
        mirror: Callable[[Any], Awaitable[None]],
        local: Callable[[], Awaitable[Any]],
    ) -> Any:
        if not self._healthy:
            await self._wait_catch_up()
        if self._healthy:
            try:
                await self._ensure_boot()
                result = await primary()
            except UNREACHABLE as exc:
                self._mark_down(exc)
            else:
                with contextlib.suppress(OwnerServeError):
                    await mirror(result)
                return result
        async with self._lock:
            self.stats["local_calls"] += 1
            result = await local()
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.stats["dropped"] += 1
            self._pending.append(_Pending(op, args, result))
            return result

    async def _wait_catch_up(self) -> None:
        """While the queued writes are replayed, wait (up to `catch_up_wait_s`) for the replay
        to end: the write then goes to Redis, after everything queued before it."""
        caught_up = self._caught_up
        if caught_up is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.catch_up_wait_s):
                await caught_up.wait()

    async def _noop(self, _: Any) -> None:
        return None

    async def _write_both(
        self, op: str, *args: Any, mirror: Callable[[Any], Awaitable[None]] | None = None
    ) -> Any:
        """The write `op(*args)` on the primary, or on the local view while the primary is
        unreachable. After the primary's answer the local view follows through `mirror`: by
        default, the same call on it."""

        async def same_call(_: Any) -> None:
            await getattr(self.local, op)(*args)

        return await self._write(
            op,
            args,
            lambda: getattr(self.primary, op)(*args),
            same_call if mirror is None else mirror,
            lambda: getattr(self.local, op)(*args),
        )

    async def _write_lease(self, op: str, artifact: Artifact | None, *args: Any) -> Lease:
        """A write answered with a lease (claim, renew): the local view takes that lease (of
        `artifact`, or of the artifact it already knows)."""

        async def mirror(lease: Lease) -> None:
            self.local.install_lease(artifact, self._seen(lease))

        lease: Lease = await self._write_both(op, *args, mirror=mirror)
        return lease

    # --- the Directory protocol ---------------------------------------------------------------

    async def register_worker(self, worker: str, model_root: int, block_size: int) -> None:
        await self._write_both("register_worker", worker, model_root, block_size)

    async def lookup(self, chain: Sequence[int], session_id: str | None = None) -> Match:
        if session_id is not None:  # what the local view's bound spares longest
            self.local.note_chain(session_id, chain if isinstance(chain, tuple) else tuple(chain))
        match: Match = await self._read(
            lambda: self.primary.lookup(chain, session_id),
            lambda: self.local.lookup(chain, session_id),
        )
        return match

    async def claim(
        self, artifact: Artifact, worker: str, lease_s: float, fence_epoch: int | None = None
    ) -> Lease:
        fence = None if fence_epoch is None else self._epoch(fence_epoch)
        return await self._write_lease("claim", artifact, artifact, worker, lease_s, fence)

    async def renew(self, artifact_id: int, worker: str, epoch: int, lease_s: float) -> Lease:
        real = self._epoch(epoch)
        return await self._write_lease("renew", None, artifact_id, worker, real, lease_s)

    async def release(self, artifact_id: int, worker: str, epoch: int) -> None:
        await self._write_both("release", artifact_id, worker, self._epoch(epoch))

    async def put_replica(self, write: ReplicaWrite) -> None:
        await self._write_both("put_replica", write)

    async def renew_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> bool:
        """Redis decides; the local view then holds the lease at that incarnation whatever it
        held (`install_replica_holder`). During an outage the local view answers and the
        renewal is queued: a replay Redis refuses (the lease lapsed there meanwhile) is a
        conflict, and the holder learns it at its next renewal, which Redis answers."""

        async def mirror(_: bool) -> None:
            self.local.install_replica_holder(worker, tier, incarnation, ttl_s)

        continued: bool = await self._write_both(
            "renew_replica_holder", worker, tier, incarnation, ttl_s, mirror=mirror
        )
        return continued

    async def add_held_replicas(
        self, worker: str, tier: Tier, incarnation: int, blocks: Sequence[int]
    ) -> None:
        await self._write_both("add_held_replicas", worker, tier, incarnation, tuple(blocks))

    async def drop_replicas(self, worker: str, tier: Tier, blocks: Sequence[int]) -> int:
        dropped: int = await self._write_both("drop_replicas", worker, tier, tuple(blocks))
        return dropped

    async def move_leases(self, move: TransferMove) -> tuple[int, tuple[Lease, ...]]:
        """As a claim: during an outage the local view hands the artifacts over at a
        provisional epoch and the call is queued; its replay maps that epoch onto the one Redis
        gives (`_settle_transfer`)."""

        async def mirror(result: tuple[int, tuple[Lease, ...]]) -> None:
            await self._install_transfer(move, result[1])

        result: tuple[int, tuple[Lease, ...]] = await self._write(
            "transfer",
            (move,),
            lambda: self.primary.move_leases(move),
            mirror,
            lambda: self.local.move_leases(move),
        )
        return result

    async def set_session_owner(self, session_id: str, worker: str, ttl_s: float) -> None:
        await self._write_both("set_session_owner", session_id, worker, ttl_s)

    async def get_session_owner(self, session_id: str) -> str | None:
        owner: str | None = await self._read(
            lambda: self.primary.get_session_owner(session_id),
            lambda: self.local.get_session_owner(session_id),
        )
        return owner

    async def add_fork_ref(self, artifact_id: int, session_id: str) -> int:
        refs: int = await self._write_both("add_fork_ref", artifact_id, session_id)
        return refs

    async def drop_fork_ref(self, artifact_id: int, session_id: str) -> int:
        refs: int = await self._write_both("drop_fork_ref", artifact_id, session_id)
        return refs

    async def _local_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        # the worker may have been registered through another router: learn it from Redis
        reg = self.primary.registration(worker)
        if reg is not None and self.local.registration(worker) != reg:
            await self.local.register_worker(worker, *reg)
        return await self.local.apply_events(worker, batch)

    async def apply_events(
        self, worker: str, batch: EventBatch, life: int | None = None
    ) -> EventApplyResult:
        """`life` fences the batch on Redis, whose life counts every replica's drops (the
        local view counts only this router's: it follows Redis's answer, and during an
        outage takes the batch; the replay is fenced on Redis)."""

        async def mirror(result: EventApplyResult) -> None:
            if result.fenced is None:
                await self._local_events(worker, batch)

        result: EventApplyResult = await self._write(
            "apply_events",
            (worker, batch, life),
            lambda: self.primary.apply_events(worker, batch, life),
            mirror,
            lambda: self._local_events(worker, batch),
        )
        return result

    async def drop_worker(self, worker: str, life: int | None = None) -> int:
        dropped: int = await self._write_both("drop_worker", worker, life)
        return dropped

    async def worker_life(self, worker: str) -> int:
        life: int = await self._read(
            lambda: self.primary.worker_life(worker), lambda: self.local.worker_life(worker)
        )
        return life

    async def artifact_info(self, artifact_id: int) -> ArtifactInfo | None:
        info: ArtifactInfo | None = await self._read(
            lambda: self.primary.artifact_info(artifact_id),
            lambda: self.local.artifact_info(artifact_id),
        )
        return info

    async def sweep(self, min_interval_s: float = 0.0) -> int:
        await self.local.sweep()
        dropped: int = await self._read(
            lambda: self.primary.sweep(min_interval_s), self.local.sweep
        )
        return dropped

    async def cached_counts(self) -> CachedCounts:
        """Redis's counts; the local view's while Redis is unreachable (what this router's
        mirrored event batches cached)."""
        counts: CachedCounts = await self._read(
            self.primary.cached_counts, self.local.cached_counts
        )
        return counts

    async def health(self) -> DirectoryHealth:
        if self._healthy:
            try:
                await self.primary.ping()
                await self._ensure_boot()
            except UNREACHABLE as exc:
                self._mark_down(exc)
        detail = "redis ok" if self._healthy else f"serving from local view: {self._last_error}"
        return DirectoryHealth(
            backend=self.backend_name,
            healthy=self._healthy,
            detail=detail,
            pending_reconcile=len(self._pending),
            stats={
                **self.stats,
                "mirror_cached_pairs": self.local.cached_pairs,
                "mirror_evicted": self.local.evicted,
            },
        )

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._reconnect)
        await self.primary.close()

    # --- reconciliation -------------------------------------------------------------------------

    async def wait_reconciled(self, timeout_s: float = 10.0) -> bool:
        """Wait until Redis is back and everything queued has been replayed."""
        deadline = time.monotonic() + timeout_s
        while not self._healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._healthy

    async def _reconnect_loop(self) -> None:
        while not self._closed and not self._healthy:
            await asyncio.sleep(self.retry_interval_s)
            try:
                await self.primary.ping()
                await self._reconcile()
            except UNREACHABLE as exc:
                self._last_error = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # keep retrying: serving locally beats a dead loop
                self._last_error = f"{type(exc).__name__}: {exc}"
                log.exception("directory: reconciliation failed; retrying")

    async def _reconcile(self) -> None:
        """Replay what was queued (or push the local view back after a data loss), new writes
        waiting meanwhile (`_wait_catch_up`); they are released when it ends either way."""
        caught_up = self._caught_up = asyncio.Event()
        try:
            await self._catch_up()
        finally:
            self._caught_up = None
            caught_up.set()

    async def _catch_up(self) -> None:
        token = await self.primary.boot_token(uuid.uuid4().hex)
        if self._boot is not None and token != self._boot:
            log.warning("directory: Redis lost its data; pushing the local view back")
            await self._resync()
            async with self._lock:
                self._pending.clear()
        self._boot = token
        # `close` sets `_closed` before it cancels: a cancel that redis-py loses (Python 3.11's
        # `wait_for` returns its inner result when the cancel lands as a call ends) must not
        # leave a long queue replaying behind a closed directory
        while not self._closed:
            async with self._lock:
                if not self._pending:
                    self._healthy = True
                    log.info("directory: Redis is back; reconciled")
                    return
                item = self._pending[0]
            await self._replay(item)
            async with self._lock:
                if self._pending and self._pending[0] is item:
                    self._pending.popleft()
                self.stats["replayed"] += 1

    async def _replay(self, item: _Pending) -> None:
        try:
            if item.op == "claim":
                artifact, worker, lease_s, fence = item.args
                provisional: Lease = item.local_result
                fence = None if fence is None else self._epoch(fence)
                lease = self._seen(await self.primary.claim(artifact, worker, lease_s, fence))
                if provisional.worker == worker and lease.worker == worker:
                    self._translate(provisional.epoch, lease)
                elif lease.worker != worker:
                    self.stats["conflicts"] += 1
                self.local.install_lease(artifact, lease)
            elif item.op == "transfer":
                (move,) = item.args
                _, leases = await self.primary.move_leases(move)
                await self._settle_transfer(move, item.local_result[1], leases)
            elif item.op in ("renew", "release"):
                aid, worker, epoch, *rest = item.args
                call = getattr(self.primary, item.op)
                await call(aid, worker, self._epoch(epoch), *rest)
            elif item.op == "apply_events":
                await self.primary.apply_events(*item.args)
            else:
                await getattr(self.primary, item.op)(*item.args)
        except UNREACHABLE:
            raise  # stays queued (ClusterDownError is also a ResponseError)
        except (StaleEpochError, InvalidRequestError, ResponseError) as exc:
            self.stats["conflicts"] += 1  # Redis said no: replaying again would not change that
            log.info("directory: replayed %s refused: %s", item.op, exc)

    async def _install_transfer(self, move: TransferMove, leases: Sequence[Lease]) -> None:
        """The local view follows a transfer Redis made (`InMemoryDirectory.install_transfer`)."""
        await self.local.install_transfer(
            move.chain,
            move.from_worker,
            move.tier,
            move.replica_ttl_s,
            [self._seen(x) for x in leases],
        )

    async def _settle_transfer(
        self, move: TransferMove, provisional: tuple[Lease, ...], leases: tuple[Lease, ...]
    ) -> None:
        """After a transfer made during an outage was replayed: its provisional epoch means the
        one Redis gave, and the local view follows Redis. An artifact the local view handed
        over but Redis did not (its lease had ended, another router dropped the worker) is a
        conflict: its provisional owner is fenced, and the local view takes Redis's lease."""
        if provisional and leases:
            for lease in leases:  # one epoch for all: the latest end counts
                self._translate(provisional[0].epoch, lease)
        await self._install_transfer(move, leases)
        moved = {x.artifact_id for x in leases}
        lost = [x for x in provisional if x.artifact_id not in moved]
        if lost:
            self.stats["conflicts"] += 1
        for x in lost:
            info = await self.primary.artifact_info(x.artifact_id)
            if info is not None and info.live:
                real = Lease(x.artifact_id, info.worker, info.epoch, info.expires_at)
                self.local.install_holder(self._seen(real))
            else:
                with contextlib.suppress(StaleEpochError):
                    await self.local.release(x.artifact_id, x.worker, x.epoch)

    async def _resync(self) -> None:
        self.stats["resyncs"] += 1
        snap = self.local.export_state()
        await self.primary.raise_epoch(self._max_primary_epoch)
        for worker, (root, block_size) in snap.registrations.items():
            await self.primary.register_worker(worker, root, block_size)
        for worker, entries in snap.cached.items():
            await self.primary.restore_cached(worker, entries)
        for artifact, old, remaining in snap.leases:
            lease = self._seen(await self.primary.claim(artifact, old.worker, remaining))
            self.local.install_lease(artifact, lease)
            if lease.worker != old.worker:
                self.stats["conflicts"] += 1  # another router got there first
                continue
            for k, v in list(self._epoch_map.items()):
                if v == old.epoch:
                    self._translate(k, lease)
            self._translate(old.epoch, lease)
        for worker, tier, ro, remaining, blocks in snap.replicas:
            await self.primary.add_replica(blocks[-1], worker, tier, remaining, ro, blocks)
        for worker, tier, incarnation, remaining in snap.holders:
            with contextlib.suppress(StaleEpochError):  # a lapsed record survived: not revived
                await self.primary.renew_replica_holder(worker, tier, incarnation, remaining)
        for worker, tier, incarnation, blocks in snap.held:
            with contextlib.suppress(StaleEpochError):
                await self.primary.add_held_replicas(worker, tier, incarnation, blocks)
        for session_id, worker, remaining in snap.sessions:
            await self.primary.set_session_owner(session_id, worker, remaining)
        for artifact_id, session_id in snap.forks:
            await self.primary.add_fork_ref(artifact_id, session_id)
