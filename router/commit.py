"""After a response: write what it changed into the ownership directory.

The decode worker now holds the prompt's KV. It claims the blocks nobody owns yet (a delta
artifact fenced by its epoch when it already owns the prefix it extends, single-owner rule 1), is
recorded as the session's decode owner, and holds a read-only replica of any prefix another
worker owns — unless the session moved there with its KV (a state migration from the prefix's
owner): then it owns that prefix, and the source's copy is a short-TTL replica that ages out
(`Directory.transfer`). A remote prefill leaves a transient copy on the prefill worker: a
short-TTL replica. A forked branch takes a copy-on-write reference on the prefix it shares.
`CommittedLeases` keeps, per worker, the blocks of the live leases these commits took: the
KV the router holds for a worker that publishes no KV events.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ownerserve.directory.base import Artifact, Directory, Lease, Match
from ownerserve.errors import StaleEpochError
from ownerserve.types import Tier
from planner.types import Action, Plan


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """How long what a commit writes lives (seconds)."""

    lease_s: float
    session_ttl_s: float
    replica_ttl_s: float
    """The transient copy a remote prefill leaves on the prefill worker, and the copy a state
    migration leaves on its source."""


class Served(Protocol):
    """One served request, as its commit needs it (the router's `aftermath.ServedRequest`)."""

    @property
    def plan(self) -> Plan: ...
    @property
    def chain(self) -> Sequence[int]: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def match(self) -> Match: ...
    @property
    def kv_bytes_per_block(self) -> int: ...
    @property
    def fork_from_blocks(self) -> int:
        """Leading blocks a forked branch shares with its session's previous prompt (else 0)."""

    @property
    def refresh(self) -> bool:
        """False when this session's unchanged records were rewritten recently."""


async def _claim(
    directory: Directory,
    chain: tuple[int, ...],
    start: int,
    worker: str,
    match: Match,
    lease_s: float,
    kv_bytes_per_block: int,
) -> Lease:
    size = (len(chain) - start) * kv_bytes_per_block
    artifact = Artifact(chain=chain, start=start, size_bytes=size)
    if start > 0 and match.owner == worker:
        try:
            return await directory.claim(artifact, worker, lease_s, fence_epoch=match.owner_epoch)
        except StaleEpochError:
            # our lease on the prefix lapsed meanwhile: claim whatever is unowned now
            pass
    return await directory.claim(artifact, worker, lease_s)


async def commit_plan(
    directory: Directory, served: Served, lifetimes: Lifetimes, *, concurrent: bool = True
) -> Lease | None:
    """Commit one served plan; returns the decode worker's lease on the new blocks, if any.

    With `served.refresh` False (the caller refreshed this session recently) records that
    are already in place — same session owner, an unexpired replica, a lease on the whole
    prompt — are not written again. With `concurrent=False` the writes run one after the
    other (for the in-process directory, whose calls never wait: no task per write)."""
    plan, chain, session_id, match = served.plan, served.chain, served.session_id, served.match
    refresh = served.refresh
    lease_s = lifetimes.lease_s
    decode = plan.chosen.decode_worker
    steps: list[Awaitable[Any]] = []
    if session_id is not None and (refresh or match.session_owner != decode):
        steps.append(directory.set_session_owner(session_id, decode, lifetimes.session_ttl_s))
    if not chain:
        for step in steps:
            await step
        return None
    full = tuple(chain)
    n = len(full)
    owned = min(match.owner_blocks, n) if match.owner is not None else 0
    if plan.action is Action.REMOTE_PREFILL and plan.chosen.prefill_worker != decode:
        steps.append(
            directory.add_replica(
                full[-1],
                plan.chosen.prefill_worker,
                Tier.GPU,
                lifetimes.replica_ttl_s,
                True,
                full,
            )
        )
    moved_from = plan.chosen.source_worker if plan.action is Action.STATE_MIGRATION else None
    if owned and moved_from is not None and match.owner == moved_from:
        # the session moved here with the prefix its source owned: ownership follows it
        steps.append(
            directory.transfer(full[:owned], moved_from, decode, lease_s, lifetimes.replica_ttl_s)
        )
    elif owned and match.owner != decode and (refresh or match.longest(decode) < owned):
        # the decode worker computed or fetched a prefix another worker owns: a replica. A
        # replica counts to its deepest live line, so between refreshes only the lines past
        # the prefix it already holds on GPU (owned, a replica, cached) are written: a turn
        # costs its new blocks, not the whole prefix (round-robin turns alternate workers,
        # each time behind the other's ownership)
        held = 0 if refresh else match.longest(decode, Tier.GPU)
        steps.append(
            directory.add_replica(
                full[owned - 1], decode, Tier.GPU, lease_s, True, full[min(held, owned) : owned]
            )
        )
    fork_from_blocks = served.fork_from_blocks
    if session_id is not None and fork_from_blocks > 0:
        steps.append(directory.add_fork_ref(full[min(fork_from_blocks, n) - 1], session_id))
    first: Awaitable[Lease | None] | None = None
    if owned < n:
        first = _claim(directory, full, owned, decode, match, lease_s, served.kv_bytes_per_block)
    elif refresh and match.owner == decode and match.owner_artifact_id is not None:
        first = _renew(directory, match.owner_artifact_id, decode, match.owner_epoch, lease_s)
    if first is not None and not steps:
        return await first
    if not concurrent:
        return await _in_order(first, steps)
    # one concurrent round: a failing write must not leave the others un-awaited
    results = await asyncio.gather(*([first] if first is not None else []), *steps)
    return results[0] if first is not None else None


async def _in_order(
    first: Awaitable[Lease | None] | None, steps: list[Awaitable[Any]]
) -> Lease | None:
    """Await every write in turn; the first failure is raised after the rest ran."""
    lease = None
    error: BaseException | None = None
    if first is not None:
        try:
            lease = await first
        except Exception as exc:
            error = exc
    for step in steps:
        try:
            await step
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    return lease


async def _renew(
    directory: Directory, artifact_id: int, worker: str, epoch: int, lease_s: float
) -> Lease | None:
    try:
        return await directory.renew(artifact_id, worker, epoch, lease_s)
    except StaleEpochError:
        return None


COMMIT_WAIT_S = 2.0
"""How long a session's next turn waits for its last answer's directory writes to land
(`PendingCommits.landed`): far above a healthy Redis round trip, below what a client would
notice; past it the turn looks up what is there."""


class PendingCommits:
    """Each session's directory writes still in flight: with a directory whose calls wait
    (Redis) an answer's commit runs beside its stream, and a client that sends its next turn
    the moment an answer ends could otherwise look up the directory before that commit landed
    (and route as if the last turn had left nothing). The next turn's lookup waits for them
    first (`landed`); the in-process directory commits inline and never has any."""

    __slots__ = ("_tasks", "wait_s")

    def __init__(self, wait_s: float = COMMIT_WAIT_S) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.wait_s = wait_s

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, session_id: str | None, task: asyncio.Task[Any]) -> None:
        """`task` writes what `session_id`'s latest answer changed (no session: nothing to
        wait for)."""
        if session_id is None:
            return
        self._tasks[session_id] = task
        task.add_done_callback(lambda done: self._forget(session_id, done))

    def _forget(self, session_id: str, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(session_id) is task:
            del self._tasks[session_id]

    async def landed(self, session_id: str | None) -> None:
        """Once `session_id`'s writes in flight ended (or `wait_s` passed); never cancels
        them, also when the caller is cancelled."""
        task = self._tasks.get(session_id) if session_id is not None else None
        if task is not None and not task.done():
            await asyncio.wait((task,), timeout=self.wait_s)


class CommittedLeases:
    """Per worker, the blocks of the live leases this router's commits took there (a claim's
    new blocks) or renewed (the count its claim gave): what the router holds for a worker
    that publishes no KV events (`ownerserve_kv_blocks{source="leases"}`). A lease counts
    until its expiry (the directory's clock: unix seconds), or until its worker dies or is
    removed (`forget_worker`); expired ones leave at the next write or `expire` (which the
    router runs every health interval: a read only reads, so a metrics export on another
    thread may call it). A heap by expiry, one entry per write: amortised O(log n) a write.
    Leases another router replica took, and leases a state migration handed over, are not
    seen here."""

    __slots__ = ("_blocks", "_clock", "_expiries", "_leases")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._leases: dict[int, tuple[str, int, float]] = {}
        """Artifact id -> (worker, blocks, expiry)."""
        self._blocks: dict[str, int] = {}
        """Per worker: the blocks of its leases here."""
        self._expiries: list[tuple[float, int]] = []
        """(expiry, artifact id) of every write, a heap; entries a later write replaced are
        skipped."""

    def held(self, lease: Lease, blocks: int | None) -> None:
        """`lease` was taken (`blocks`: its new blocks) or renewed (None: the blocks its
        claim counted, if this ledger saw it; a renewal of a lease it never saw adds none)."""
        now = self._clock()
        self.expire(now)
        old = self._leases.pop(lease.artifact_id, None)
        if old is not None:
            self._add(old[0], -old[1])
            if blocks is None:
                blocks = old[1]
        if blocks is None or blocks <= 0 or lease.expires_at <= now:
            return
        self._leases[lease.artifact_id] = (lease.worker, blocks, lease.expires_at)
        self._add(lease.worker, blocks)
        heapq.heappush(self._expiries, (lease.expires_at, lease.artifact_id))

    def blocks(self, worker: str) -> int:
        """The blocks of `worker`'s leases this router took, as of the last write or
        `expire` (a plain read)."""
        return self._blocks.get(worker, 0)

    def forget_worker(self, worker: str) -> None:
        """`worker` died or left: its leases end (the directory drops them too)."""
        for aid in [a for a, (w, _, _) in self._leases.items() if w == worker]:
            del self._leases[aid]
        self._blocks.pop(worker, None)

    def __len__(self) -> int:
        return len(self._leases)

    def _add(self, worker: str, blocks: int) -> None:
        n = self._blocks.get(worker, 0) + blocks
        if n > 0:
            self._blocks[worker] = n
        else:
            self._blocks.pop(worker, None)

    def expire(self, now: float | None = None) -> None:
        """Drop the leases expired at `now` (default: the clock's now)."""
        if now is None:
            now = self._clock()
        heap, leases = self._expiries, self._leases
        while heap and heap[0][0] <= now:
            expires_at, aid = heapq.heappop(heap)
            entry = leases.get(aid)
            if entry is not None and entry[2] == expires_at:
                del leases[aid]
                self._add(entry[0], -entry[1])
        if not leases:
            heap.clear()
