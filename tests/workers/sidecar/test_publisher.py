"""The replica publisher's loop: what it writes to the directory (one holder lease per tier,
renewed in O(1); the lines written again only where the directory lost them), and that
closing it always stops it (a close racing a wake-up once left the sidecar's shutdown waiting
forever) and ends its lines at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.types import Tier
from tests.waiting import until
from workers.sidecar.publisher import ReplicaPublisher


async def test_new_blocks_are_published_in_one_call_per_tier() -> None:
    directory = InMemoryDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU, 3: Tier.SSD}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=30.0, flush_every_s=0.01)
    pub.start()
    pub.note(held)
    await until(lambda: pub.stats().published_blocks == 3, what="the noted blocks published")
    await pub.close()
    assert pub.stats().published_blocks == 3 and pub.stats().publish_calls == 2
    assert (await directory.lookup([1, 2])).longest("w0", Tier.CPU) == 2
    assert (await directory.lookup([3])).longest("w0", Tier.SSD) == 1


async def test_close_stops_the_loop_however_it_races_a_wake_up() -> None:
    """`note` wakes the loop; `close` cancels it k event-loop turns later. On Python 3.11 a
    cancel that lands after the wake-up completed `asyncio.wait_for`'s inner wait, but before
    the loop resumed, was swallowed by `wait_for`: the loop ran on and `close` never returned.
    Each k must close within 2 s here."""
    for k in range(8):
        pub = ReplicaPublisher(InMemoryDirectory(), "w0", dict, ttl_s=300.0, flush_every_s=5.0)
        pub.start()
        await asyncio.sleep(0.01)  # the loop is waiting for a wake-up
        pub.note({k: Tier.CPU})
        for _ in range(k):
            await asyncio.sleep(0)
        # not `asyncio.timeout(...)` around `close()`: that would cancel the loop and pass
        closing = asyncio.create_task(pub.close())
        done, _ = await asyncio.wait([closing], timeout=2.0)
        if not done:
            closing.cancel()
            await asyncio.wait([closing])
        assert done, f"close() still waiting for the loop 2 s after a wake-up {k} turns before"


async def test_close_raises_what_stopped_the_loop() -> None:
    """A loop that died of an error (here: `holdings` failing at a renew) is not hidden by
    `close`."""

    def holdings() -> dict[int, Tier]:
        raise RuntimeError("holdings failed")

    pub = ReplicaPublisher(InMemoryDirectory(), "w0", holdings, ttl_s=0.03)
    pub.start()
    await asyncio.sleep(0.1)  # past the first renew (every ttl_s / 3)
    with pytest.raises(RuntimeError, match="holdings failed"):
        await pub.close()


class _FailingDirectory(InMemoryDirectory):
    async def renew_replica_holder(self, *args: object, **kwargs: object) -> bool:
        raise ConnectionError("directory down")


async def test_closing_ends_the_lines_at_once_and_a_failed_end_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = InMemoryDirectory()
    held = {1: Tier.CPU, 2: Tier.SSD}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    assert (await directory.lookup([1])).longest("w0", Tier.CPU) == 1
    pub.note({3: Tier.CPU})
    with caplog.at_level(logging.WARNING, logger="workers.sidecar.publisher"):
        await pub.close()

    async def ended() -> bool:
        return (await directory.lookup([1])).longest("w0") == 0 and (
            await directory.lookup([2])
        ).longest("w0") == 0

    await until(ended, what="the closed holder's lines no longer counted")
    assert any("1 replicas of w0 unpublished" in r.getMessage() for r in caplog.records)

    failing = _FailingDirectory()
    pub = ReplicaPublisher(failing, "w0", dict, ttl_s=300.0)
    pub._holding.add(Tier.CPU)  # as after a publish: the lease is ended at close
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.sidecar.publisher"):
        await pub.close()
    assert pub.stats().failures == 1
    assert any("directory down" in r.getMessage() for r in caplog.records)


class CountingDirectory(InMemoryDirectory):
    """Counts the held lines written."""

    lines_written = 0

    async def add_held_replicas(
        self, worker: str, tier: Tier, incarnation: int, blocks: Sequence[int]
    ) -> None:
        self.lines_written += len(blocks)
        await super().add_held_replicas(worker, tier, incarnation, blocks)


async def test_a_renewal_writes_one_lease_per_tier_not_the_lines() -> None:
    directory = CountingDirectory()
    held = {b: Tier.CPU for b in range(100)} | {b: Tier.SSD for b in range(100, 150)}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    assert directory.lines_written == 150
    renewals = pub.stats().holder_renewals
    await pub.renew()
    await pub.renew()
    assert directory.lines_written == 150  # no line written again
    assert pub.stats().holder_renewals == renewals + 4  # 2 tiers x 2 renewals
    assert (await directory.lookup(list(range(100)))).longest("w0", Tier.CPU) == 100


async def test_a_lapsed_holder_starts_a_new_incarnation_and_writes_everything_again() -> None:
    """The worker was declared dead (`drop_worker` ends its holders), or this process stalled
    past the TTL: the next renewal starts over under a new incarnation."""
    directory = CountingDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU, 3: Tier.SSD}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    first = pub.incarnation
    await directory.drop_worker("w0")
    assert (await directory.lookup([1, 2])).longest("w0") == 0
    await pub.renew()
    assert pub.incarnation != first and pub.stats().incarnations == 2
    assert directory.lines_written == 6
    assert (await directory.lookup([1, 2])).longest("w0", Tier.CPU) == 2
    assert (await directory.lookup([3])).longest("w0", Tier.SSD) == 1


async def test_a_lease_the_directory_lost_is_started_again_with_its_lines() -> None:
    """A directory that lost its dataset answers the renewal by starting a lease: the
    publisher writes that tier's blocks again under the same incarnation."""
    directory = CountingDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    lost = CountingDirectory()  # the same directory after losing every record
    pub.directory = lost
    await pub.renew()
    assert lost.lines_written == 2 and pub.stats().incarnations == 1
    assert (await lost.lookup([1, 2])).longest("w0", Tier.CPU) == 2


async def test_renewal_withdraws_blocks_no_longer_held_or_moved_to_another_tier() -> None:
    directory = InMemoryDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU, 3: Tier.CPU}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    assert (await directory.lookup([1, 2, 3])).longest("w0", Tier.CPU) == 3
    held = {1: Tier.CPU, 2: Tier.SSD}  # 2 demoted, 3 gone
    await pub.renew()
    assert pub.stats().withdrawn_blocks == 2  # their CPU lines, dropped

    async def withdrawn() -> bool:
        match = await directory.lookup([1, 2, 3])
        return match.longest("w0", Tier.CPU) == 1 and match.longest("w0", Tier.SSD) == 2

    await until(withdrawn, what="2's CPU line and 3 withdrawn")
    assert (await directory.lookup([3])).longest("w0") == 0


class FlakyDirectory(InMemoryDirectory):
    """An in-memory directory whose replica withdrawals and holder renewals fail while
    `down`."""

    down = False

    async def drop_replicas(self, worker: str, tier: Tier, blocks: Sequence[int]) -> int:
        if self.down:
            raise ConnectionError("directory down")
        return await super().drop_replicas(worker, tier, blocks)

    async def renew_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> bool:
        if self.down:
            raise ConnectionError("directory down")
        return await super().renew_replica_holder(worker, tier, incarnation, ttl_s)


async def test_renewal_audits_first_and_a_failed_withdrawal_is_tried_again() -> None:
    directory = FlakyDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU}
    audits: list[int] = []

    async def audit() -> None:  # the backing store lost block 2
        audits.append(1)
        held.pop(2, None)

    pub = ReplicaPublisher(directory, "w0", lambda: dict(held), ttl_s=300.0, audit=audit)
    await pub.publish(held)
    directory.down = True
    await pub.renew()
    assert audits == [1] and pub.stats().withdrawn_blocks == 0
    directory.down = False
    assert (await directory.lookup([1, 2])).longest("w0", Tier.CPU) == 2  # not withdrawn yet
    await pub.renew()
    assert pub.stats().withdrawn_blocks == 1

    async def withdrawn() -> bool:
        return (await directory.lookup([1, 2])).longest("w0", Tier.CPU) == 1

    await until(withdrawn, what="block 2 withdrawn at the next renewal")
