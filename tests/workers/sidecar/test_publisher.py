"""The replica publisher's loop: what it writes to the directory, and that closing it always
stops it (a close racing a wake-up once left the sidecar's shutdown waiting forever)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ownerserve.directory.common import ReplicaWrite
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
    async def add_replica(self, *args: object, **kwargs: object) -> None:
        raise ConnectionError("directory down")


async def test_a_failed_last_flush_at_close_is_counted_and_logged_with_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = ReplicaPublisher(_FailingDirectory(), "w0", dict, ttl_s=300.0)
    pub.note({1: Tier.CPU, 2: Tier.SSD})
    with caplog.at_level(logging.WARNING, logger="workers.sidecar.publisher"):
        await pub.close()
    assert pub.stats().failures == 1 and pub.stats().published_blocks == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("directory down" in m for m in messages), messages
    assert any("2 replicas of w0 unpublished" in m for m in messages), messages


async def test_renewal_withdraws_blocks_no_longer_held_or_moved_to_another_tier() -> None:
    directory = InMemoryDirectory()
    held = {1: Tier.CPU, 2: Tier.CPU, 3: Tier.CPU}
    pub = ReplicaPublisher(directory, "w0", lambda: held, ttl_s=300.0)
    await pub.publish(held)
    assert (await directory.lookup([1, 2, 3])).longest("w0", Tier.CPU) == 3
    held = {1: Tier.CPU, 2: Tier.SSD}  # 2 demoted, 3 gone
    await pub.renew()
    assert pub.stats().withdrawn_blocks == 2  # their CPU lines, rewritten to expire at once

    async def withdrawn() -> bool:
        match = await directory.lookup([1, 2, 3])
        return match.longest("w0", Tier.CPU) == 1 and match.longest("w0", Tier.SSD) == 2

    await until(withdrawn, what="2's CPU line and 3 withdrawn")
    assert (await directory.lookup([3])).longest("w0") == 0


class FlakyDirectory(InMemoryDirectory):
    """An in-memory directory whose replica writes fail while `down`."""

    down = False

    async def put_replica(self, write: ReplicaWrite) -> None:
        if self.down:
            raise ConnectionError("directory down")
        await super().put_replica(write)


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
