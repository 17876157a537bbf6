"""vllm-router's `consistent_hash` (160 virtual nodes per worker, load-blind) and
`power_of_two` (two draws, the less loaded)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ownerserve.types import Role
from planner.policies import get_policy
from planner.policies.peers.consistent_hash import HashRing
from tests.planner.util import UNIT_CONFIG, cluster, request, unit_model, worker

MODEL = unit_model()


def test_a_session_stays_on_its_worker_whatever_the_load() -> None:
    pol = get_policy("vllm-consistent-hash", UNIT_CONFIG, MODEL)
    cl = cluster(*(worker(f"h{i}", Role.HYBRID) for i in range(4)))
    first = pol.plan(request(500, session_id="s1"), cl).chosen.decode_worker
    loaded = cluster(*(replace(w, running=100) if w.worker_id == first else w
                       for w in cl.workers))  # fmt: skip
    assert pol.plan(request(900, session_id="s1"), loaded).chosen.decode_worker == first


def test_ring_spreads_sessions_and_moves_few_when_a_worker_joins() -> None:
    ids = tuple(f"h{i}" for i in range(4))
    ring = HashRing(ids, 160)
    assert len(ring.hashes) == 4 * 160
    counts = Counter(ring.lookup(f"s{i}") for i in range(4000))
    assert set(counts) == set(ids) and min(counts.values()) > 600
    bigger = HashRing((*ids, "h4"), 160)
    moved = sum(ring.lookup(f"s{i}") != bigger.lookup(f"s{i}") for i in range(4000))
    assert moved < 4000 * 0.3  # about 1/5 move, all to the new worker
    assert all(bigger.lookup(f"s{i}") in (ring.lookup(f"s{i}"), "h4") for i in range(4000))


def test_unhealthy_target_falls_back_to_the_first_healthy_worker() -> None:
    pol = get_policy("vllm-consistent-hash", UNIT_CONFIG, MODEL)
    cl = cluster(*(worker(f"h{i}", Role.HYBRID) for i in range(4)))
    target = pol.plan(request(500, session_id="s9"), cl).chosen.decode_worker
    sick = cluster(*(replace(w, healthy=w.worker_id != target) for w in cl.workers))
    first_healthy = next(w.worker_id for w in sick.workers if w.healthy)
    assert pol.plan(request(500, session_id="s9"), sick).chosen.decode_worker == first_healthy


def test_power_of_two_takes_the_less_loaded_of_its_draw() -> None:
    pol = get_policy("vllm-power-of-two", UNIT_CONFIG, MODEL)
    two = cluster(worker("a", Role.HYBRID, running=3), worker("b", Role.HYBRID, waiting=2))
    assert {pol.plan(request(500), two).chosen.decode_worker for _ in range(20)} == {"b"}
    many = cluster(*(worker(f"h{i}", Role.HYBRID, running=i) for i in range(4)))
    picks = Counter(pol.plan(request(500), many).chosen.decode_worker for _ in range(600))
    # the busiest worker never wins a draw; the idlest wins every draw it is in (1/2)
    assert "h3" not in picks and 250 < picks["h0"] < 350
