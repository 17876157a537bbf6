"""Replica holders (`renew_replica_holder`, `add_held_replicas`, `drop_replicas`): one liveness
lease per (worker, tier) keeps any number of held replica lines alive, on every backend."""

from __future__ import annotations

import pytest

from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.errors import InvalidRequestError, StaleEpochError
from ownerserve.types import Tier
from tests.ownerserve.directory.conftest import Backend
from tests.ownerserve.directory.test_contract import CHAIN, LONG, SHORT, SHORT_SEEN

INC = 1234567890123


async def test_held_lines_count_while_their_holder_lives(backend: Backend) -> None:
    d = backend.directory
    assert await d.renew_replica_holder("w1", Tier.CPU, INC, LONG) is False  # started
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:6])
    m = await d.lookup(CHAIN[:8])
    assert m.longest("w1", Tier.CPU) == 6
    assert await d.renew_replica_holder("w1", Tier.CPU, INC, LONG) is True  # extended
    assert (await d.lookup(CHAIN[:8])).longest("w1", Tier.CPU) == 6
    assert (await d.lookup(CHAIN[:8])).longest("w1", Tier.SSD) == 0  # per tier


async def test_held_lines_stop_counting_once_the_holder_lapses_and_it_is_not_revived(
    backend: Backend,
) -> None:
    d = backend.directory
    await d.renew_replica_holder("w1", Tier.CPU, INC, SHORT_SEEN)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:4])
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 4
    await backend.advance(SHORT_SEEN + 0.1)
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 0  # no sweep needed
    with pytest.raises(StaleEpochError):
        await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    with pytest.raises(StaleEpochError):
        await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:2])
    # a new incarnation starts afresh: the old lines do not come back with it
    assert await d.renew_replica_holder("w1", Tier.CPU, INC + 1, LONG) is False
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 0
    await d.add_held_replicas("w1", Tier.CPU, INC + 1, CHAIN[:2])
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 2


async def test_a_new_incarnation_supersedes_a_live_one_at_once(backend: Backend) -> None:
    """A restarted sidecar's first renewal: its dead predecessor's lines count no more."""
    d = backend.directory
    await d.renew_replica_holder("w1", Tier.SSD, INC, LONG)
    await d.add_held_replicas("w1", Tier.SSD, INC, CHAIN[:5])
    assert await d.renew_replica_holder("w1", Tier.SSD, INC + 7, LONG) is False
    assert (await d.lookup(CHAIN[:5])).longest("w1", Tier.SSD) == 0
    with pytest.raises(StaleEpochError):
        await d.add_held_replicas("w1", Tier.SSD, INC, CHAIN[:5])  # the old one's writes
    assert await d.sweep() == 5  # the superseded lines are purged


async def test_add_held_replicas_needs_a_live_holder_at_that_incarnation(
    backend: Backend,
) -> None:
    d = backend.directory
    with pytest.raises(StaleEpochError):
        await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:3])
    assert (await d.lookup(CHAIN[:3])).longest("w1") == 0
    await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    with pytest.raises(StaleEpochError):
        await d.add_held_replicas("w1", Tier.SSD, INC, CHAIN[:3])  # no holder in that tier
    with pytest.raises(StaleEpochError):
        await d.add_held_replicas("w1", Tier.CPU, INC + 1, CHAIN[:3])
    for bad in (0, -1, 1 << 63, True, "12"):
        with pytest.raises(InvalidRequestError):
            await d.renew_replica_holder("w1", Tier.CPU, bad, LONG)  # type: ignore[arg-type]


async def test_sweep_purges_a_lapsed_holder_s_lines_and_keeps_a_live_one_s(
    backend: Backend,
) -> None:
    d = backend.directory
    await d.renew_replica_holder("w1", Tier.CPU, INC, SHORT)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:10])
    await d.renew_replica_holder("w2", Tier.CPU, INC, LONG)
    await d.add_held_replicas("w2", Tier.CPU, INC, CHAIN[:3])
    await backend.advance(SHORT + 0.1)
    assert await d.sweep() == 10
    assert await d.sweep() == 0
    m = await d.lookup(CHAIN[:10])
    assert (m.longest("w1"), m.longest("w2", Tier.CPU)) == (0, 3)


async def test_a_held_line_and_a_ttl_line_replace_each_other(backend: Backend) -> None:
    d = backend.directory
    await d.add_replica(CHAIN[3], "w1", Tier.CPU, SHORT, blocks=CHAIN[:4])
    await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:4])
    await backend.advance(SHORT + 0.1)  # the TTL lines' expiry: replaced, so nothing ends
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 4
    await d.add_replica(CHAIN[1], "w1", Tier.CPU, LONG, blocks=CHAIN[:2])
    await d.renew_replica_holder("w1", Tier.CPU, INC + 1, LONG)  # the held lines end
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 2  # the TTL lines live


async def test_drop_replicas_withdraws_held_and_ttl_lines_of_one_tier(backend: Backend) -> None:
    d = backend.directory
    await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:6])
    await d.add_replica(CHAIN[5], "w1", Tier.SSD, LONG, blocks=CHAIN[:6])
    assert await d.drop_replicas("w1", Tier.CPU, CHAIN[3:6]) == 3
    assert await d.drop_replicas("w1", Tier.CPU, CHAIN[3:6]) == 0
    assert await d.drop_replicas("w1", Tier.SSD, CHAIN[:1]) == 1
    m = await d.lookup(CHAIN[:6])
    assert (m.longest("w1", Tier.CPU), m.longest("w1", Tier.SSD)) == (3, 6)
    assert await d.drop_replicas("w9", Tier.CPU, CHAIN[:6]) == 0


async def test_drop_worker_ends_its_holders_for_good(backend: Backend) -> None:
    d = backend.directory
    await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:4])
    await d.drop_worker("w1")
    assert (await d.lookup(CHAIN[:4])).longest("w1") == 0
    with pytest.raises(StaleEpochError):
        await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    assert await d.renew_replica_holder("w1", Tier.CPU, INC + 1, LONG) is False
    await d.add_held_replicas("w1", Tier.CPU, INC + 1, CHAIN[:2])
    assert (await d.lookup(CHAIN[:4])).longest("w1", Tier.CPU) == 2


async def test_the_snapshot_holds_live_holders_and_their_lines() -> None:
    d = InMemoryDirectory()
    await d.renew_replica_holder("w1", Tier.CPU, INC, LONG)
    await d.add_held_replicas("w1", Tier.CPU, INC, CHAIN[:3])
    snap = d.export_state()
    assert [(w, t, i) for w, t, i, _ in snap.holders] == [("w1", Tier.CPU, INC)]
    assert snap.held == [("w1", Tier.CPU, INC, CHAIN[:3])]
    assert snap.replicas == []
