"""Publishes the blocks a sidecar holds to the ownership directory as read-only replicas of its
worker (tier `cpu` for the memory tier, `ssd` for files), and keeps them alive.

The sidecar is a *replica holder* of its worker in each tier (`Directory.
renew_replica_holder`): one liveness lease per (worker, tier), renewed every `renew_every_s`
(a third of `ttl_s`) by one O(1) write, however many blocks it holds. Its lines
(`add_held_replicas`) carry no TTL of their own: they count in lookups while that lease lives
at this publisher's *incarnation* (a random id drawn at start). A sidecar that dies stops
renewing, and every one of its lines stops counting within one TTL at once (this is the
worker's liveness as the directory sees it); the directory's sweep purges them later. New
blocks are published within `flush_every_s`, batched into one call per tier.

A renewal that finds the lease gone starts over: where the directory says the lease was
started afresh (its dataset was lost, or it never saw this incarnation) the publisher writes
every held block of that tier again; where it says this incarnation lapsed or was ended
(`drop_worker` after the worker died, or this process stalled past the TTL) it draws a new
incarnation and writes every held block under it. So a renewal costs one write, and the
whole holding is written only when the directory lost it.

A block published but no longer held at a renewal (its artifacts dropped, or lost behind the
sidecar: `audit`, run just before each renewal, finds what the sidecar's backing store lost)
is withdrawn then (`drop_replicas`), not left to the holder's lease: so the directory stops
naming a lost block within one renewal of the audit that found it, and a withdrawal that failed
is tried again at the next renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ownerserve.directory import Directory
from ownerserve.errors import StaleEpochError
from ownerserve.types import Tier

log = logging.getLogger(__name__)


END_TTL_S = 0.001
"""The lease a closing holder renews with: it lapses at once (the directory takes no 0)."""


def new_incarnation() -> int:
    """A random holder incarnation in [1, 2^63)."""
    return secrets.randbelow((1 << 63) - 1) + 1


@dataclass(frozen=True, slots=True)
class PublishStats:
    """Counters of a publisher."""

    published_blocks: int
    publish_calls: int
    failures: int
    withdrawn_blocks: int = 0
    holder_renewals: int = 0
    incarnations: int = 1
    """Lives this publisher's holding had: 1, plus one per lapse it recovered from."""


@dataclass(slots=True)
class ReplicaPublisher:
    """Writes `holdings()` (chunk hash -> tier) to `directory` as replicas of `worker`, held
    by one liveness lease per tier (see the module docstring)."""

    directory: Directory
    worker: str
    holdings: Callable[[], Mapping[int, Tier]]
    ttl_s: float = 30.0
    flush_every_s: float = 0.2
    audit: Callable[[], Awaitable[None]] | None = None
    """Run before each renewal: drops from `holdings()` what the sidecar no longer has."""
    incarnation: int = field(default_factory=new_incarnation)
    _holding: set[Tier] = field(default_factory=set)
    """Tiers whose holder lease this incarnation has started (and whose lines it wrote)."""
    _dirty: dict[int, Tier] = field(default_factory=dict)
    _published: dict[int, Tier] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _published_blocks: int = 0
    _calls: int = 0
    _failures: int = 0
    _withdrawn: int = 0
    _renewals: int = 0
    _incarnations: int = 1

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def note(self, blocks: Mapping[int, Tier]) -> None:
        """Blocks newly stored (or moved between tiers): publish them soon."""
        if blocks:
            self._dirty.update(blocks)
            self._wake.set()

    def stats(self) -> PublishStats:
        return PublishStats(
            self._published_blocks,
            self._calls,
            self._failures,
            self._withdrawn,
            self._renewals,
            self._incarnations,
        )

    async def publish(self, blocks: Mapping[int, Tier]) -> None:
        """One `add_held_replicas` per tier for `blocks` (the tier's holder lease started
        first where this incarnation has none); raises what the directory raises. A holder
        found lapsed starts a new incarnation: every held block is then due again, and the
        `StaleEpochError` is raised for the caller to count."""
        for tier, hashes in _by_tier(blocks).items():
            try:
                if tier not in self._holding:
                    await self.directory.renew_replica_holder(
                        self.worker, tier, self.incarnation, self.ttl_s
                    )
                    self._holding.add(tier)
                    self._renewals += 1
                await self.directory.add_held_replicas(self.worker, tier, self.incarnation, hashes)
            except StaleEpochError:
                self._start_over()
                raise
            self._calls += 1
            self._published_blocks += len(hashes)
            for block in hashes:
                self._published[block] = tier

    def _start_over(self) -> None:
        """A new incarnation: what the old one wrote counts no more, all held is due."""
        self.incarnation = new_incarnation()
        self._incarnations += 1
        self._holding.clear()
        self._published.clear()
        self._dirty.update(self.holdings())
        self._wake.set()

    async def withdraw(self, blocks: Mapping[int, Tier]) -> None:
        """End the replicas of `blocks` (block -> the tier it was published in) now; raises
        what the directory raises."""
        for tier, hashes in _by_tier(blocks).items():
            await self.directory.drop_replicas(self.worker, tier, hashes)
            self._calls += 1
            self._withdrawn += len(hashes)
            for block in hashes:
                if self._published.get(block) is tier:
                    del self._published[block]

    async def flush(self) -> None:
        """Publish the blocks noted since the last flush (kept for the next try on failure)."""
        if not self._dirty:
            return
        batch, self._dirty = self._dirty, {}
        try:
            await self.publish(batch)
        except Exception as exc:
            self._failures += 1
            for block, tier in batch.items():
                self._dirty.setdefault(block, tier)
            log.warning("publishing %d replicas of %s failed: %r", len(batch), self.worker, exc)

    async def renew(self) -> None:
        """Audit, withdraw what was published and is no longer held (in that tier), renew
        each tier's holder lease (O(1) each), and write a tier's held blocks again only where
        the directory lost its lease; then publish what is due, and what is held but was
        never published in its tier."""
        if self.audit is not None:
            try:
                await self.audit()
            except Exception as exc:  # what is held stays as it was known: renewed
                log.warning("auditing the replicas of %s failed: %r", self.worker, exc)
        held = dict(self.holdings())
        gone = {b: t for b, t in self._published.items() if held.get(b) is not t}
        if gone:
            try:
                await self.withdraw(gone)
            except Exception as exc:  # still in `_published`: tried again at the next renewal
                self._failures += 1
                log.warning("withdrawing %d replicas of %s failed: %r", len(gone), self.worker, exc)
        for tier in sorted(self._holding, key=lambda t: t.value):
            try:
                continued = await self.directory.renew_replica_holder(
                    self.worker, tier, self.incarnation, self.ttl_s
                )
            except StaleEpochError as exc:
                log.warning(
                    "replica holder %s/%s lapsed (%s): starting over", self.worker, tier, exc
                )
                self._start_over()
                break
            except Exception as exc:  # the next renewal tries again, within the TTL
                self._failures += 1
                log.warning("renewing the replica holder %s/%s failed: %r", self.worker, tier, exc)
                continue
            self._renewals += 1
            if not continued:  # the directory had no lease of ours: its lines are gone
                log.warning("replica holder %s/%s was lost: publishing again", self.worker, tier)
                self._dirty.update({b: t for b, t in held.items() if t is tier})
        # held and not published as such (a move between tiers not noted): due now too
        self._dirty.update({b: t for b, t in held.items() if self._published.get(b) is not t})
        await self.flush()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + self.renew_every_s
        while True:
            timeout = max(0.0, next_renew - loop.time())
            # `asyncio.timeout`, not `wait_for`: on 3.11 `wait_for` swallows a cancel that lands
            # just after its inner wait finished, and `close` would then wait forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            if loop.time() >= next_renew:
                await self.renew()
                next_renew = loop.time() + self.renew_every_s
            else:
                await self.flush()
                # batch what arrives in a burst (a connector saving block after block)
                await asyncio.sleep(self.flush_every_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop the loop, then end this incarnation's holder leases: a closed sidecar serves
        nothing, so its lines stop counting now rather than within a TTL (a restarted one
        publishes what it kept under a new incarnation). An end that fails is counted and
        logged with its error, and the lines then end with the lease; blocks noted and not yet
        published are logged, not published."""
        if self._task is not None:
            task = self._task
            task.cancel()
            await asyncio.wait([task])  # a cancel of close() itself still propagates
            if not task.cancelled():
                task.result()  # a loop that had died of an error raises it here
            self._task = None
        for tier in sorted(self._holding, key=lambda t: t.value):
            try:
                await self.directory.renew_replica_holder(
                    self.worker, tier, self.incarnation, END_TTL_S
                )
            except Exception as exc:
                self._failures += 1
                log.warning(
                    "ending the replica holder %s/%s failed (its lines end with its lease): %r",
                    self.worker,
                    tier,
                    exc,
                )
        self._holding.clear()
        if self._dirty:
            log.warning(
                "closing with %d replicas of %s unpublished (they are not retried)",
                len(self._dirty),
                self.worker,
            )


def _by_tier(blocks: Mapping[int, Tier]) -> dict[Tier, list[int]]:
    by_tier: dict[Tier, list[int]] = {}
    for block, tier in blocks.items():
        by_tier.setdefault(tier, []).append(block)
    return by_tier
