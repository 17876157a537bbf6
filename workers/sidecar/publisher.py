"""Publishes the blocks a sidecar holds to the ownership directory as read-only replicas of its
worker (tier `cpu` for the memory tier, `ssd` for files), and keeps them alive.

Replicas expire after `ttl_s` unless renewed: every `renew_every_s` the publisher writes every
held block again, and a sidecar that dies stops renewing, so its replicas disappear from
lookups within one TTL (this is the worker's liveness as the directory sees it). New blocks
are published within `flush_every_s`, batched into one `add_replica` call per tier.

A block published but no longer held at a renewal (its artifacts dropped, or lost behind the
sidecar: `audit`, run just before each renewal, finds what the sidecar's backing store lost)
is withdrawn then, not left to expire: the directory has no call that deletes one replica, so
the publisher writes that block's line again with an expiry of `WITHDRAW_TTL_S` (a worker's
line per block and tier is replaced by each write, in memory and on Redis alike; `sweep`
purges it). So the directory stops naming a lost block within one renewal of the audit that
found it, and a withdrawal that failed is tried again at the next renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ownerserve.directory import Directory
from ownerserve.types import Tier

log = logging.getLogger(__name__)

WITHDRAW_TTL_S = 0.001
"""The expiry a withdrawn replica's line is rewritten with (the directory takes no 0)."""


@dataclass(frozen=True, slots=True)
class PublishStats:
    """Counters of a publisher."""

    published_blocks: int
    publish_calls: int
    failures: int
    withdrawn_blocks: int = 0


@dataclass(slots=True)
class ReplicaPublisher:
    """Writes `holdings()` (chunk hash -> tier) to `directory` as replicas of `worker`."""

    directory: Directory
    worker: str
    holdings: Callable[[], Mapping[int, Tier]]
    ttl_s: float = 30.0
    flush_every_s: float = 0.2
    audit: Callable[[], Awaitable[None]] | None = None
    """Run before each renewal: drops from `holdings()` what the sidecar no longer has."""
    _dirty: dict[int, Tier] = field(default_factory=dict)
    _published: dict[int, Tier] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _published_blocks: int = 0
    _calls: int = 0
    _failures: int = 0
    _withdrawn: int = 0

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def note(self, blocks: Mapping[int, Tier]) -> None:
        """Blocks newly stored (or moved between tiers): publish them soon."""
        if blocks:
            self._dirty.update(blocks)
            self._wake.set()

    def stats(self) -> PublishStats:
        return PublishStats(self._published_blocks, self._calls, self._failures, self._withdrawn)

    async def publish(self, blocks: Mapping[int, Tier]) -> None:
        """One `add_replica` per tier for `blocks`; raises what the directory raises."""
        for tier, hashes in _by_tier(blocks).items():
            await self.directory.add_replica(
                hashes[-1], self.worker, tier, self.ttl_s, True, hashes
            )
            self._calls += 1
            self._published_blocks += len(hashes)
            for block in hashes:
                self._published[block] = tier

    async def withdraw(self, blocks: Mapping[int, Tier]) -> None:
        """End the replicas of `blocks` (block -> the tier it was published in) now; raises
        what the directory raises."""
        for tier, hashes in _by_tier(blocks).items():
            await self.directory.add_replica(
                hashes[-1], self.worker, tier, WITHDRAW_TTL_S, True, hashes
            )
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
        """Audit, withdraw what was published and is no longer held (in that tier), then write
        every held block again (extends the TTL of what is still stored)."""
        if self.audit is not None:
            try:
                await self.audit()
            except Exception as exc:  # what is held stays as it was known: renewed
                log.warning("auditing the replicas of %s failed: %r", self.worker, exc)
        held = dict(self.holdings())
        self._dirty.clear()
        gone = {b: t for b, t in self._published.items() if held.get(b) is not t}
        if gone:
            try:
                await self.withdraw(gone)
            except Exception as exc:  # still in `_published`: tried again at the next renewal
                self._failures += 1
                log.warning("withdrawing %d replicas of %s failed: %r", len(gone), self.worker, exc)
        try:
            await self.publish(held)
        except Exception as exc:
            self._failures += 1
            self._dirty.update(held)
            log.warning("renewing %d replicas of %s failed: %r", len(held), self.worker, exc)

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
        """Stop the loop, then one last flush (replicas then expire on their own). A failed last
        flush is counted and logged with its error, as every flush is, and not retried."""
        if self._task is not None:
            task = self._task
            task.cancel()
            await asyncio.wait([task])  # a cancel of close() itself still propagates
            if not task.cancelled():
                task.result()  # a loop that had died of an error raises it here
            self._task = None
        await self.flush()
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
