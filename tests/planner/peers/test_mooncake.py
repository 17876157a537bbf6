"""Mooncake's Conductor: the least predicted TTFT over prefill instances, the balancing
threshold between a local and a fetched prefix, early rejection."""

from __future__ import annotations

import pytest

from ownerserve.types import KVTransport, Role
from planner.policies import get_policy
from planner.policies.peers import RequestRejectedError
from planner.policies.peers.mooncake import MooncakeConductorPolicy
from planner.types import Action
from tests.planner.util import UNIT, UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()


def conductor() -> MooncakeConductorPolicy:
    pol = get_policy("mooncake-conductor", UNIT_CONFIG, MODEL)
    assert isinstance(pol, MooncakeConductorPolicy)
    return pol


def test_ttft_is_queue_plus_prefill_of_the_uncached_part() -> None:
    pol = conductor()
    p1 = worker("p1", Role.PREFILL, gpu=15, inflight_prefill_tokens=100, waiting=1)
    o = pol.option(p1, request(2000), 15, p1)
    assert o.source is None
    assert o.ttft_s == pytest.approx(1e-4 * 100 + 0.01 * 1 + UNIT.prefill_s(500, 1500))


def test_balancing_threshold_decides_between_local_and_fetched_prefix() -> None:
    pol = conductor()
    holder = worker("h", Role.PREFILL, "node1", gpu=15)
    near = worker("p", Role.PREFILL, gpu=13)  # 15 / 13 < 1.25: its own prefix
    assert pol.option(near, request(2000), 15, holder).source is None
    far = worker("p", Role.PREFILL, gpu=12)  # 15 / 12 = 1.25: fetch the longer one
    o = pol.option(far, request(2000), 15, holder)
    assert o.source is holder
    transfer = UNIT.link.transfer_s(3 * 100 * 1000, transport=KVTransport.STORE_RDMA)
    assert o.ttft_s == pytest.approx(transfer + UNIT.prefill_s(500, 1500))


def test_plan_takes_the_least_ttft_and_fetches_when_that_is_quicker() -> None:
    pol = conductor()
    idle_holder = cluster(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL, gpu=15),
                          worker("d0", Role.DECODE))  # fmt: skip
    p = pol.plan(request(2000), idle_holder)
    assert (p.action, p.chosen.prefill_worker, p.chosen.decode_worker) == (
        Action.REMOTE_PREFILL, "p1", "d0",
    )  # fmt: skip
    busy_holder = cluster(worker("p0", Role.PREFILL),
                          worker("p1", Role.PREFILL, gpu=15, inflight_prefill_tokens=1000),
                          worker("d0", Role.DECODE))  # fmt: skip
    p = pol.plan(request(2000), busy_holder)
    assert (p.action, p.chosen.prefill_worker, p.chosen.source_worker) == (
        Action.ARTIFACT_FETCH, "p0", "p1",
    )  # fmt: skip


def test_rejects_when_no_instance_meets_the_slo() -> None:
    pol = conductor()
    # the TTFT SLO is 10 × prefill_s(2000, 0) = 2.3 s; 3 s of queue everywhere
    swamped = cluster(worker("p0", Role.PREFILL, inflight_prefill_tokens=30_000),
                      worker("d0", Role.DECODE))  # fmt: skip
    with pytest.raises(RequestRejectedError) as exc:
        pol.plan(request(2000), swamped)
    assert exc.value.status_code == 429
    # the TBT SLO is 5 × decode_step_s(1, 2000) = 0.0256 s: a step of 206 sequences exceeds it
    crowded = cluster(worker("p0", Role.PREFILL), worker("d0", Role.DECODE, running=205))
    with pytest.raises(RequestRejectedError):
        pol.plan(request(2000), crowded)
    assert pol.plan(request(2000), cluster(worker("p0", Role.PREFILL), worker("d0", Role.DECODE,
                    running=204))).chosen.decode_worker == "d0"  # fmt: skip


def test_the_prefix_comes_from_the_nearest_or_least_queued_copy() -> None:
    pol = conductor()
    far_busy = worker("h0", Role.DECODE, "node1", gpu=15, nic_backlog_s=5.0)
    far_idle = worker("h1", Role.DECODE, "node2", gpu=15, nic_backlog_s=0.5)
    cold = worker("p0", Role.PREFILL, "node0")
    o = pol.best_prefill([cold], request(2000), cluster(far_busy, far_idle, cold))
    assert o.source is far_idle
    transfer = UNIT.link.transfer_s(15 * 100 * 1000, transport=KVTransport.STORE_RDMA)
    assert o.ttft_s == pytest.approx(0.5 + transfer + UNIT.prefill_s(500, 1500))
    near = worker("h2", Role.DECODE, "node0", gpu=15, nic_backlog_s=9.0)
    o = pol.best_prefill([cold], request(2000), cluster(far_busy, far_idle, near, cold))
    assert o.source is near  # same node: no NIC in the way
    assert o.ttft_s == pytest.approx(
        UNIT.link.transfer_s(15 * 100 * 1000, transport=KVTransport.SAME_HOST)
        + UNIT.prefill_s(500, 1500)
    )
