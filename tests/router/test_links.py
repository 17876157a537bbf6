"""`NicLedger`: the router's FIFO estimate of each node's NIC backlog."""

from __future__ import annotations

import pytest

from router.links import NicLedger


def test_transfers_queue_one_after_another_and_drain_with_time() -> None:
    nics = NicLedger()
    assert nics.backlog("n0", 100.0) == 0.0 and not nics
    nics.reserve("n0", 2.0, 100.0)
    assert len(nics) == 1
    nics.reserve("n0", 3.0, 100.5)  # waits for the first: n0 is busy until 105
    assert nics.backlog("n0", 101.0) == pytest.approx(4.0)
    assert nics.backlog("n1", 101.0) == 0.0
    assert nics.snapshot(101.0) == pytest.approx({"n0": 4.0})
    assert nics.backlog("n0", 105.0) == 0.0
    assert nics.snapshot(105.0) == {} and not nics


def test_a_transfer_queued_on_an_idle_nic_starts_now() -> None:
    nics = NicLedger()
    nics.reserve("n0", 1.0, 10.0)
    nics.reserve("n0", 1.0, 50.0)  # the first ended at 11: this one runs 50-51
    assert nics.backlog("n0", 50.0) == pytest.approx(1.0)


def test_released_transfers_leave_the_queue_and_nothing_goes_negative() -> None:
    nics = NicLedger()
    nics.reserve("n0", 2.0, 0.0)
    nics.reserve("n0", 3.0, 0.0)
    nics.release("n0", 3.0, 1.0)
    assert nics.backlog("n0", 1.0) == pytest.approx(1.0)
    nics.release("n0", 5.0, 1.0)  # more than is left: empty, not below now
    assert nics.backlog("n0", 1.0) == 0.0
    nics.release("n1", 1.0, 1.0)  # a node with nothing queued: nothing to take back
    nics.reserve("n0", 0.0, 1.0)  # a transfer that takes no time queues nothing
    assert nics.snapshot(1.0) == {}
